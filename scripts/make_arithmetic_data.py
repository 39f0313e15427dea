"""Write the CPU demo's prompt set, `trl_roundalign/data/arithmetic.jsonl` (deterministic for a seed).

python scripts/make_arithmetic_data.py            # 500 problems, seed 0 (the packaged file)
python scripts/make_arithmetic_data.py --check    # exit 1 if the packaged file differs
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from trl_roundalign.data import ARITHMETIC_PATH, ARITHMETIC_SEED, ARITHMETIC_SIZE, make_arithmetic_problems

logger = logging.getLogger("make_arithmetic_data")


def render(rows: list[dict]) -> str:
    """JSON Lines, one problem a line, keys in a fixed order, UTF-8 without escapes."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=ARITHMETIC_SIZE, help="number of problems")
    parser.add_argument("--seed", type=int, default=ARITHMETIC_SEED, help="random seed")
    parser.add_argument("--out", type=Path, default=ARITHMETIC_PATH, help="output JSONL file")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    text = render(make_arithmetic_problems(args.num, args.seed))
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="utf-8") == text
        logger.info("%s %s", args.out, "is up to date" if same else "differs from the generator")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    logger.info("wrote %d problems (seed %d) to %s", args.num, args.seed, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
