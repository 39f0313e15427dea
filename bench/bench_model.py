"""Forward + backward latency and memory of one training micro-batch, per alignment condition.

Models: Qwen3-1.7B, Qwen3-4B, Qwen3-8B and DeepSeek-R1-Distill-Qwen-1.5B (Qwen2), built from their published
config values with random bf16 weights and a reduced layer count (stated in the output; every layer has the
real widths). Conditions:

| condition | what runs |
|---|---|
| `bf16_default` | Hugging Face eager (transformers 5.17 modules, sdpa attention): the paper's default BF16 |
| `rope_only` | RoPE (Qwen3: q/k-norm + RoPE) aligned, default backend (Triton on CUDA, the reference on CPU) |
| `three_region:triton` | RoPE, SwiGLU, residual add + RMSNorm aligned (fp32 residual stream), Triton kernels |
| `three_region:torch` | the same with the exact PyTorch reference |
| `liger` | liger-kernel's RoPE, SwiGLU and RMSNorm (`apply_liger_kernel_to_qwen3/qwen2`), the peer a user would pick |

each with gradient checkpointing off and on (`use_reentrant=False`, as the recipes). Every configuration is
timed interleaved with the others (round-robin) on one model, switching patches between calls; the table gives
the median time (GPU: wall clock; CPU: process CPU time of single-threaded torch, since the machine is shared),
the median per-round ratio to `bf16_default` with the same checkpointing, and memory: `peak` allocated during
forward + backward above the weights, and `held` after the forward (activations; under checkpointing the layer
inputs, which the fp32 residual stream makes fp32). Memory is also extrapolated to the real depth: the per-layer
slope is measured by running the first layer alone, and `full = built + slope * (real - built layers)`.

What is timed (`--head`): `none` (default) times the decoder stack, embedding lookup to final norm, with a fixed
upstream gradient on the final hidden states and the embedding frozen: the lm head, the log-softmax and the
embedding gradient are the same in every condition, so leaving them out gives an upper bound of the relative
overhead for the full model. `logprobs` adds the lm head and the sampled tokens' log-probs (a GRPO micro-batch).

Triton and Liger run on CUDA only; on a CPU they are skipped with the reason, unless `--interpret` (tiny model,
Triton interpreter: proves the code path, no speed).

Usage: `python bench/bench_model.py [--models Qwen3-1.7B,...] [--layers N] [--batch B] [--seq T] [--quick]`.
Results: a table on stdout, `bench_model.json`/`.csv` appended under `--out` (default bench/results/).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

CONDITIONS = ("bf16_default", "rope_only", "three_region:triton", "three_region:torch", "liger")
PAPER = {
    "latency_overhead_pct": (5.33, 10.92),
    "peak_memory_overhead_gib": (0.41, 0.89),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="Qwen3-1.7B,Qwen3-4B,Qwen3-8B,DeepSeek-R1-Distill-Qwen-1.5B")
    p.add_argument("--layers", default=None, help="decoder layers built per model (default 4 on GPU, 2 on CPU; 'full')")
    p.add_argument(
        "--batch", type=int, default=None, help="sequences per micro-batch (default: the recipe's on GPU, 1 on CPU)"
    )
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048 on GPU, 128 on CPU)")
    p.add_argument("--conditions", default=",".join(CONDITIONS))
    p.add_argument("--checkpointing", default="off,on", help="gradient checkpointing settings to run: off,on")
    p.add_argument("--head", choices=("none", "logprobs"), default="none")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 10 on GPU, 7 on CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 3 on GPU, 1 on CPU)")
    p.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default 1, see harness)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: skip the remaining models (reported) when the next would likely not finish in time",
    )
    p.add_argument("--quick", action="store_true", help="smoke test: one tiny Qwen3, one round")
    p.add_argument("--interpret", action="store_true", help="CPU: run Triton/Liger under the Triton interpreter")
    p.add_argument("--out", default=None, help="folder for bench_model.json/.csv (default bench/results)")
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

from trl_roundalign.patching import apply_roundalign, revert_roundalign  # noqa: E402

PROFILE = "vllm-compiled"


# --------------------------------------------------------------------------------------------- conditions


@contextlib.contextmanager
def liger_applied(model, model_type: str):
    """Liger's RoPE/SwiGLU/RMSNorm on `model`, undone on exit (module globals and instance attributes)."""
    import importlib

    from liger_kernel.transformers import apply_liger_kernel_to_qwen2, apply_liger_kernel_to_qwen3

    fn = {"qwen3": apply_liger_kernel_to_qwen3, "qwen2": apply_liger_kernel_to_qwen2}[model_type]
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    saved_globals = dict(vars(mod))
    saved_attrs = {id(m): dict(m.__dict__) for m in model.modules()}
    fn(rope=True, swiglu=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model)
    try:
        yield
    finally:
        for k in [k for k in vars(mod) if k not in saved_globals]:
            delattr(mod, k)
        for k, v in saved_globals.items():
            if vars(mod).get(k) is not v:
                setattr(mod, k, v)
        for m in model.modules():
            before = saved_attrs[id(m)]
            for k in [k for k in m.__dict__ if k not in before]:
                del m.__dict__[k]
            for k, v in before.items():
                if m.__dict__.get(k) is not v:
                    m.__dict__[k] = v


@contextlib.contextmanager
def condition_applied(model, model_type: str, condition: str, checkpointing: bool, dev: torch.device):
    """Install one condition (and the checkpointing setting) for the duration of the block."""
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    name, _, backend = condition.partition(":")
    try:
        if name == "bf16_default":
            yield
        elif name == "liger":
            with liger_applied(model, model_type):
                yield
        else:
            regions = ("rope",) if name == "rope_only" else ("rope", "swiglu", "rmsnorm")
            backend = backend or ("triton" if dev.type == "cuda" else "torch")
            apply_roundalign(model, regions, PROFILE, backend, positions_from_mask=False)
            try:
                yield
            finally:
                revert_roundalign(model)
    finally:
        model.gradient_checkpointing_disable()


def backend_of(condition: str, dev: torch.device) -> str:
    name, _, backend = condition.partition(":")
    if name == "bf16_default":
        return "hf eager"
    if name == "liger":
        return "liger (triton)"
    return backend or ("triton" if dev.type == "cuda" else "torch")


def skip_reason(condition: str, dev: torch.device, interpret: bool) -> str | None:
    backend = backend_of(condition, dev)
    if "triton" not in backend or dev.type == "cuda":
        if condition == "liger":
            try:
                import liger_kernel  # noqa: F401
            except ImportError:
                return "liger-kernel is not installed"
        return None
    if interpret:
        return None
    return "Triton kernels need a GPU (on CPU only the interpreter runs them: --interpret, tiny model, no speed)"


# --------------------------------------------------------------------------------------------- model


def build_model(shape: harness.ModelShape, layers: int, head: str, dev: torch.device):
    from transformers import AutoModel, AutoModelForCausalLM

    cfg = shape.config(layers)
    torch.manual_seed(0)
    with torch.device(dev):
        model = (AutoModelForCausalLM if head == "logprobs" else AutoModel).from_config(cfg, dtype=torch.bfloat16)
    model.train()
    if head == "none":
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Log-probs of `index` under `logits`, one sequence at a time in fp32 (TRL's memory-saving form)."""
    out = []
    for row_logits, row_ids in zip(logits, index):
        lp = torch.log_softmax(row_logits.float(), dim=-1)
        out.append(lp.gather(-1, row_ids.unsqueeze(-1)).squeeze(-1))
    return torch.stack(out)


def make_step(model, head: str, ids: torch.Tensor, grad_h: torch.Tensor | None):
    """`forward()` -> what `backward(out)` needs, for one micro-batch."""

    if head == "none":

        def forward():
            return model(input_ids=ids, use_cache=False).last_hidden_state

        def backward(h):
            torch.autograd.backward(h, grad_h)

    else:

        def forward():
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
            logits = model.lm_head(hidden[:, :-1])
            return -selective_log_softmax(logits, ids[:, 1:]).mean()

        def backward(loss):
            loss.backward()

    def fwd_bwd():
        backward(forward())
        for p in model.parameters():
            p.grad = None

    return forward, backward, fwd_bwd


@contextlib.contextmanager
def truncated(model, n: int):
    """Run only the first `n` decoder layers inside the block."""
    from trl_roundalign.models import find_backbone

    backbone = find_backbone(model)
    layers = backbone.layers
    backbone.layers = torch.nn.ModuleList(list(layers)[:n])
    try:
        yield
    finally:
        backbone.layers = layers


def memory_by_depth(model, forward, backward, dev, layers: int, full_layers: int) -> dict:
    """Peak and held memory of the built model, and both extrapolated to the real depth.

    Memory grows linearly with the number of identical layers; the slope is measured with the first layer
    alone against all `layers` (exact for what autograd holds; the peak's slope is the same within the
    allocator's rounding), then `value(full) = value(layers) + slope * (full - layers)`.
    """

    def once():
        mem = harness.measure_memory(forward, backward, dev)
        for p in model.parameters():
            p.grad = None
        return mem

    mem = once()
    out = {"peak_mib": round(mem["peak"] / harness.MiB, 1), "held_mib": round(mem["held"] / harness.MiB, 1)}
    if layers >= 2:
        with truncated(model, 1):
            one = once()
        for key in ("peak", "held"):
            slope = (mem[key] - one[key]) / (layers - 1)
            out[f"{key}_per_layer_mib"] = round(slope / harness.MiB, 2)
            out[f"{key}_full_gib"] = round((mem[key] + slope * (full_layers - layers)) / harness.GiB, 3)
    return out


def bench_one_model(shape: harness.ModelShape, args, dev, conditions, ckpts, interpret) -> list[dict]:
    on_gpu = dev.type == "cuda"
    layers = shape.num_hidden_layers if args.layers == "full" else int(args.layers or (4 if on_gpu else 2))
    layers = min(layers, shape.num_hidden_layers)
    batch = args.batch or (shape.recipe_batch if on_gpu else 1)
    seq = args.seq or (2048 if on_gpu else 128)
    if args.quick:
        batch, seq = args.batch or 2, args.seq or 16
    repeats = args.repeats or (1 if args.quick else 10 if on_gpu else 7)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1 if not on_gpu else 3)

    model = build_model(shape, layers, args.head, dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, shape.vocab_size, (batch, seq), generator=g).to(dev)
    grad_h = (torch.randn(batch, seq, shape.hidden_size, generator=g) * seq**-0.5).to(torch.bfloat16).to(dev)
    forward, backward, fwd_bwd = make_step(model, args.head, ids, grad_h if args.head == "none" else None)

    configs = [(c, ck) for ck in ckpts for c in conditions]
    skipped = {c: skip_reason(c, dev, interpret) for c in conditions}
    errors: dict[tuple, str] = {}
    runnable = []
    for cfg in configs:
        if skipped[cfg[0]]:
            continue
        try:
            with condition_applied(model, shape.model_type, cfg[0], cfg[1], dev):
                fwd_bwd()
            runnable.append(cfg)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            errors[cfg] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    print(
        f"# {shape.name}: {layers}/{shape.num_hidden_layers} layers, {batch} x {seq} tokens, {len(runnable)} "
        f"configurations x {warmup}+{repeats} rounds ...",
        flush=True,
    )
    clock = harness.primary_clock(dev)
    times: dict[tuple, dict[str, list[float]]] = {cfg: {"wall": [], "cpu": []} for cfg in runnable}
    bar = tqdm(total=(warmup + repeats) * len(runnable), desc=shape.name, disable=not sys.stderr.isatty())
    for r in range(warmup + repeats):
        for cfg in runnable:
            with condition_applied(model, shape.model_type, cfg[0], cfg[1], dev):
                harness.gc_collect()
                wall, cpu = harness.timed(fwd_bwd, dev)
            if r >= warmup:
                times[cfg]["wall"].append(wall)
                times[cfg]["cpu"].append(cpu)
            bar.update(1)
    bar.close()

    rows = []
    for cond, ck in configs:
        row = {
            "model": shape.name,
            "layers": f"{layers}/{shape.num_hidden_layers}",
            "batch": batch,
            "seq": seq,
            "head": args.head,
            "condition": cond.partition(":")[0],
            "backend": backend_of(cond, dev),
            "checkpointing": "on" if ck else "off",
        }
        why = skipped[cond] or errors.get((cond, ck))
        if why:
            row["note"] = "skipped (see header)" if skipped[cond] else f"skipped: {why}"
            row["skip_reason"] = why
            rows.append(row)
            continue
        with condition_applied(model, shape.model_type, cond, ck, dev):
            mem = memory_by_depth(model, forward, backward, dev, layers, shape.num_hidden_layers)
        t = times[(cond, ck)]
        base = times.get(("bf16_default", ck))
        ratio = harness.paired_ratio(t[clock], base[clock]) if base else None
        iqr = harness.paired_ratio_iqr(t[clock], base[clock]) if base else float("nan")
        row.update(
            time_ms=round(1e3 * harness.median(t[clock]), 2),
            clock=clock,
            wall_ms=round(1e3 * harness.median(t["wall"]), 2),
            rounds=len(t[clock]),
            vs_default=round(ratio, 4) if ratio is not None else None,
            overhead_pct=round(100 * (ratio - 1), 2) if ratio is not None else None,
            overhead_iqr_pct=round(100 * iqr, 1) if iqr == iqr else None,
            **mem,
            note="Triton interpreter: not a speed" if interpret and "triton" in backend_of(cond, dev) else "",
        )
        rows.append(row)
    # memory deltas against bf16_default with the same checkpointing
    for row in rows:
        base = next(
            (
                r
                for r in rows
                if r["condition"] == "bf16_default" and r["checkpointing"] == row["checkpointing"] and "peak_mib" in r
            ),
            None,
        )
        if base and "peak_mib" in row:
            for key in ("peak_mib", "held_mib", "peak_full_gib", "held_full_gib"):
                if row.get(key) is not None and base.get(key) is not None:
                    row["d_" + key] = round(row[key] - base[key], 3 if key.endswith("gib") else 1)
    del model, forward, backward, fwd_bwd
    harness.release_device_memory()
    return rows


COLUMNS = [
    ("model", "model"),
    ("layers", "layers"),
    ("condition", "condition"),
    ("backend", "backend"),
    ("checkpointing", "ckpt"),
    ("time_ms", "fwd+bwd ms"),
    ("overhead_pct", "vs default %"),
    ("overhead_iqr_pct", "IQR %"),
    ("peak_mib", "peak MiB"),
    ("held_mib", "held MiB"),
    ("held_per_layer_mib", "held/layer MiB"),
    ("d_peak_full_gib", "Δpeak full GiB"),
    ("d_held_full_gib", "Δheld full GiB"),
    ("note", "note"),
]


def main(args: argparse.Namespace) -> int:
    dev = harness.device()
    thread_note = harness.set_cpu_threads(args.threads, dev)
    interpret = bool(args.interpret) and dev.type != "cuda"
    models = ["tiny-qwen3"] if args.quick and args.models == parse_args([]).models else args.models.split(",")
    conditions = [c for c in args.conditions.split(",") if c]
    for c in conditions:
        if c not in CONDITIONS:
            raise SystemExit(f"unknown condition {c!r}; choose from {', '.join(CONDITIONS)}")
    ckpts = [{"off": False, "on": True}[c] for c in args.checkpointing.split(",") if c]
    env = harness.environment(dev)
    print(f"# bench_model: device {env['device']}")
    print(
        f"# torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}, "
        f"liger-kernel {env['liger_kernel']}, commit {env['commit']}"
    )
    if thread_note:
        print(f"# {thread_note}")
    for cond in conditions:
        why = skip_reason(cond, dev, interpret)
        if why:
            print(f"# {cond}: skipped: {why}")
    rows = []
    start, longest = time.perf_counter(), 0.0
    for name in models:
        shape = harness.get_shape(name)
        elapsed = time.perf_counter() - start
        if args.time_budget is not None and elapsed + 1.2 * longest > args.time_budget:
            print(f"# {name}: skipped, time budget ({args.time_budget:.0f} s) nearly spent after {elapsed:.0f} s")
            rows.append({"model": name, "condition": "-", "note": f"skipped: time budget {args.time_budget:.0f} s"})
            continue
        t0 = time.perf_counter()
        rows += bench_one_model(shape, args, dev, conditions, ckpts, interpret)
        longest = max(longest, time.perf_counter() - t0)
    print()
    print(harness.format_table(rows, COLUMNS))
    r0 = next((r for r in rows if "time_ms" in r), rows[0] if rows else {})
    print(
        f"# {r0.get('batch')} x {r0.get('seq')} tokens per micro-batch, layers built/real as shown, head={args.head}; "
        f"time: {'wall clock' if dev.type == 'cuda' else 'process CPU time'}, median of interleaved rounds; "
        "'vs default': median per-round ratio to bf16_default (same ckpt) - 1; 'full depth': memory extrapolated "
        "linearly to the real layer count (slope from 1 vs all built layers)"
    )
    print(
        f"# paper (three-region alignment, full models): +{PAPER['latency_overhead_pct'][0]}-"
        f"{PAPER['latency_overhead_pct'][1]}% fwd+bwd latency, +{PAPER['peak_memory_overhead_gib'][0]}-"
        f"{PAPER['peak_memory_overhead_gib'][1]} GiB peak allocated per GPU"
    )
    if not args.no_save:
        settings = {
            "models": models,
            "conditions": conditions,
            "checkpointing": args.checkpointing,
            "head": args.head,
            "profile": PROFILE,
            "quick": args.quick,
            "interpret": interpret,
            "paper": PAPER,
        }
        paths = harness.append_results("bench_model", env, settings, rows, args.out)
        print(f"# appended to {paths['json']} and {paths['csv']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
