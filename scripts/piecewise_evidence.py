"""Evidence for the piecewise residual stream: what vLLM-CPU compiled the CUDA way actually computes.

Builds `tiny_model("qwen3")` (2 layers) with `build_llm(piecewise=True)` (vLLM's CUDA default:
`VLLM_COMPILE`, graph split at the attention ops) and writes, for each model piece Inductor
generated, its kernels' names and signatures and its `call` function (which buffers cross the
split, which kernel computes which sum) to `docs/results/piecewise/`, with the reduction lanes read
from the code and the machine's vector ISA.

Run: `.venv/bin/python scripts/piecewise_evidence.py` (about 2 minutes on a 2-core CPU).
"""

from __future__ import annotations

import json
import platform
import re
import sys
from pathlib import Path

from trl_roundalign.engine import set_offline_defaults

ROOT = Path(__file__).resolve().parents[1]
set_offline_defaults(ROOT / ".cache")


def main() -> int:
    from trl_roundalign.engine import (
        build_llm,
        close_llm,
        cpu_vector_isa,
        engine_info,
        inductor_reduction_lanes,
        profile_for_engine,
    )
    from trl_roundalign.engine.lanes import _inductor_modules, _module_lanes
    from trl_roundalign.local_models import tiny_model

    out = ROOT / "docs" / "results" / "piecewise"
    out.mkdir(parents=True, exist_ok=True)
    llm = build_llm(tiny_model("qwen3"), piecewise=True)
    info = engine_info(llm)
    isa = cpu_vector_isa()
    modules = _inductor_modules(info.inductor_dir)
    summary = {
        "model": "tiny_model('qwen3'): 2 layers, hidden 128, q/k-norm",
        "engine": info.as_dict(),
        "profile_for_engine": profile_for_engine(info),
        "cpu": platform.processor() or platform.machine(),
        "inductor_vector_isa": isa,
        "reduction_lanes_in_forward_order": inductor_reduction_lanes(llm),
        "pieces": [],
    }
    for i, src in enumerate(sorted(modules, key=lambda s: ("embedding" not in s, "index_select" not in s))):
        kind = "first" if "embedding" in src else ("middle" if "index_select" in src else "last")
        sigs = re.findall(r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\((\[.*?\])", src, re.M)
        call = src[src.index("    def call(self, args):") : src.index("runner = Runner")]
        (out / f"piece_{i}_{kind}_call.py.txt").write_text(
            "# kernels (name, argument types)\n" + "\n".join(f"# {n}: {a}" for n, a in sigs) + "\n\n" + call
        )
        summary["pieces"].append({"file": f"piece_{i}_{kind}_call.py.txt", "kind": kind, "lanes": _module_lanes(src, isa[1])})
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    close_llm(llm)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
