"""Time and size each aligned region against Hugging Face eager (and Liger), forward and forward + backward.

Regions (as they sit in a decoder layer of the chosen model shape):

- `rope`: q and k rotated (Qwen2/Llama form), outputs in the `[B, H, T, D]` layout attention reads;
- `qk_norm_rope`: Qwen3's q/k RMSNorm followed by RoPE;
- `swiglu`: `silu(gate) * up`;
- `rms_norm`: RMSNorm of a bf16 input (layer-0 input norm);
- `add_rms_norm`: residual add + RMSNorm (Hugging Face: bf16 residual; aligned: the fp32 residual stream,
  in and out, as the engine carries it).

Implementations: `hf` (the transformers 5.17 functions and modules, op for op), `torch` (the aligned
PyTorch reference, `backend="torch"`), `triton` (the aligned Triton kernels) and `liger` (liger-kernel's
RoPE, SwiGLU and RMSNorm, the peer a user would otherwise pick). Triton and Liger need a GPU; on a CPU
they are skipped with the reason, except that `--interpret` runs them under the Triton interpreter on a
tiny shape to prove the code path (those timings are not speeds).

Memory per call (see `harness`): `peak` allocated above the inputs during forward + backward, `held`
after forward (outputs + what backward keeps), and `saved` bytes handed to `save_for_backward`.

Usage: `python bench/bench_ops.py [--model Qwen3-8B] [--batch B --seq T] [--quick] [--interpret] [--out DIR]`.
Results: a table on stdout, and `bench_ops.json`/`.csv` appended under `--out` (default bench/results/).
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="Qwen3-8B", help="model shape whose widths are used (default Qwen3-8B)")
    p.add_argument("--batch", type=int, default=None, help="sequences (default: the recipe's on GPU, 1 on CPU)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096 on GPU, 512 on CPU)")
    p.add_argument("--regions", default="rope,qk_norm_rope,swiglu,rms_norm,add_rms_norm")
    p.add_argument("--impls", default="hf,torch,triton,liger")
    p.add_argument("--repeats", type=int, default=None, help="CPU: timed rounds (default 15; --quick 3)")
    p.add_argument("--warmup", type=int, default=2, help="CPU: untimed rounds first")
    p.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default 1; see harness.cpu_threads)")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny shape, few repeats")
    p.add_argument(
        "--interpret",
        action="store_true",
        help="CPU: run the Triton and Liger kernels under the Triton interpreter (tiny shape; proves the path, no speed)",
    )
    p.add_argument("--out", default=None, help="folder for bench_ops.json/.csv (default bench/results)")
    p.add_argument("--no-save", action="store_true", help="print only, append nothing")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.interpret:
    # Must precede the first import of any Triton kernel module (triton.jit reads it at decoration).
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

from trl_roundalign import ops  # noqa: E402

PROFILE = "vllm-compiled"
BF16 = torch.bfloat16


def _cos_sin(shape: harness.ModelShape, batch: int, seq: int, dev: torch.device):
    """Hugging Face's default RoPE table for positions 0..seq-1: `[B, T, D]` in bf16 (halves duplicated)."""
    d = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    pos = torch.arange(seq, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
    return (cos[None].expand(batch, -1, -1).contiguous().to(dev), sin[None].expand(batch, -1, -1).contiguous().to(dev))


def _leaf(*size, dev, dtype=BF16, scale=1.0, offset=0.0) -> torch.Tensor:
    return (torch.randn(*size, device=dev, dtype=torch.float32) * scale + offset).to(dtype).requires_grad_(True)


class Case:
    """One region: leaf tensors and, per implementation, a forward returning its output tensors."""

    def __init__(self, region: str, leaves: list[torch.Tensor], impls: dict, note: str = ""):
        self.region, self.leaves, self.impls, self.note = region, leaves, impls, note
        self._grads: dict[str, list[torch.Tensor]] = {}

    def grads(self, impl: str, outs) -> list[torch.Tensor]:
        if impl not in self._grads:
            g = torch.Generator(device=outs[0].device).manual_seed(1)
            self._grads[impl] = [
                torch.randn(o.shape, generator=g, device=o.device, dtype=torch.float32).to(o.dtype) for o in outs
            ]
        return self._grads[impl]

    def forward(self, impl: str):
        return self.impls[impl]()

    def backward(self, impl: str, outs):
        return torch.autograd.grad(outs, self.leaves, self.grads(impl, outs), allow_unused=True)

    def fwd_bwd(self, impl: str):
        return self.backward(impl, self.forward(impl))


def build_case(
    region: str, shape: harness.ModelShape, batch: int, seq: int, dev: torch.device, impls: list[str]
) -> Case:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    torch.manual_seed(0)
    b, t, hq, hk, d = batch, seq, shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
    h, inter, eps = shape.hidden_size, shape.intermediate_size, shape.rms_norm_eps
    fns: dict = {}

    def liger():
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        return LigerSiLUMulFunction, LigerRMSNorm, liger_rotary_pos_emb

    def norm_module(cls, width: int, weight: torch.nn.Parameter):
        mod = cls(width, eps=eps).to(dev)
        mod.weight = weight
        return mod

    if region in ("rope", "qk_norm_rope"):
        cos, sin = _cos_sin(shape, b, t, dev)
        cos4, sin4 = cos.unsqueeze(2), sin.unsqueeze(2)
        q, k = _leaf(b, t, hq, d, dev=dev), _leaf(b, t, hk, d, dev=dev)
        leaves = [q, k]
        if region == "rope":

            def hf():
                return apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)

            def aligned(backend):
                def fn():
                    qo = ops.rope(q, cos4, sin4, profile=PROFILE, backend=backend)
                    ko = ops.rope(k, cos4, sin4, profile=PROFILE, backend=backend)
                    return qo.transpose(1, 2), ko.transpose(1, 2)

                return fn

            def lig():
                return liger()[2](q.transpose(1, 2), k.transpose(1, 2), cos, sin)

        else:
            wq = torch.nn.Parameter((1.0 + 0.1 * torch.randn(d, device=dev)).to(BF16))
            wk = torch.nn.Parameter((1.0 + 0.1 * torch.randn(d, device=dev)).to(BF16))
            leaves += [wq, wk]
            hf_q, hf_k = norm_module(Qwen3RMSNorm, d, wq), norm_module(Qwen3RMSNorm, d, wk)

            def hf():
                return apply_rotary_pos_emb(hf_q(q).transpose(1, 2), hf_k(k).transpose(1, 2), cos, sin)

            def aligned(backend):
                def fn():
                    qo = ops.qk_norm_rope(q, wq, eps, cos4, sin4, profile=PROFILE, backend=backend)
                    ko = ops.qk_norm_rope(k, wk, eps, cos4, sin4, profile=PROFILE, backend=backend)
                    return qo.transpose(1, 2), ko.transpose(1, 2)

                return fn

            lig_mods: list = []

            def lig():
                if not lig_mods:
                    cls = liger()[1]
                    lig_mods.extend([norm_module(cls, d, wq), norm_module(cls, d, wk)])
                qn, kn = lig_mods[0](q).transpose(1, 2), lig_mods[1](k).transpose(1, 2)
                return liger()[2](qn, kn, cos, sin)

        fns = {"hf": hf, "torch": aligned("torch"), "triton": aligned("triton"), "liger": lig}
        note = f"q [{b},{t},{hq},{d}] + k [{b},{t},{hk},{d}]"
    elif region == "swiglu":
        gate, up = _leaf(b, t, inter, dev=dev, scale=2.0), _leaf(b, t, inter, dev=dev)
        leaves = [gate, up]
        act = torch.nn.SiLU()
        fns = {
            "hf": lambda: (act(gate) * up,),
            "torch": lambda: (ops.swiglu(gate, up, profile=PROFILE, backend="torch"),),
            "triton": lambda: (ops.swiglu(gate, up, profile=PROFILE, backend="triton"),),
            "liger": lambda: (liger()[0].apply(gate, up),),
        }
        note = f"gate, up [{b},{t},{inter}]"
    elif region in ("rms_norm", "add_rms_norm"):
        w = torch.nn.Parameter((1.0 + 0.1 * torch.randn(h, device=dev)).to(BF16))
        x = _leaf(b, t, h, dev=dev)
        hf_norm = norm_module(Qwen3RMSNorm, h, w)
        lig_mods = []

        def lig_norm():
            if not lig_mods:
                lig_mods.append(norm_module(liger()[1], h, w))
            return lig_mods[0]

        if region == "rms_norm":
            leaves = [x, w]
            fns = {
                "hf": lambda: (hf_norm(x),),
                "torch": lambda: (ops.rms_norm(x, w, eps, profile=PROFILE, backend="torch"),),
                "triton": lambda: (ops.rms_norm(x, w, eps, profile=PROFILE, backend="triton"),),
                "liger": lambda: (lig_norm()(x),),
            }
            note = f"x [{b},{t},{h}] bf16"
        else:
            res16 = _leaf(b, t, h, dev=dev, scale=4.0)
            res32 = (res16.detach().float() + 0.01 * torch.randn(b, t, h, device=dev)).requires_grad_(True)
            leaves = [x, res16, res32, w]

            def hf():
                res = res16 + x
                return hf_norm(res), res

            def lig():
                res = res16 + x
                return lig_norm()(res), res

            fns = {
                "hf": hf,
                "torch": lambda: ops.add_rms_norm(x, res32, w, eps, profile=PROFILE, backend="torch"),
                "triton": lambda: ops.add_rms_norm(x, res32, w, eps, profile=PROFILE, backend="triton"),
                "liger": lig,
            }
            note = f"x [{b},{t},{h}] bf16; residual bf16 (hf, liger) / fp32 (aligned)"
    else:
        raise SystemExit(f"unknown region {region!r}")
    return Case(region, leaves, {k: v for k, v in fns.items() if k in impls}, note)


def availability(impl: str, dev: torch.device, interpret: bool) -> str | None:
    """None if `impl` can run here, else the reason it is skipped."""
    if impl in ("hf", "torch"):
        return None
    if dev.type == "cuda":
        if impl == "liger":
            try:
                import liger_kernel  # noqa: F401
            except ImportError:
                return "liger-kernel not installed (pip install liger-kernel)"
        return None
    if not interpret:
        return "Triton kernels need a GPU; on CPU only the interpreter runs them (--interpret: tiny shape, no speed)"
    return None


def run(args: argparse.Namespace) -> tuple[list[dict], dict, dict]:
    dev = harness.device()
    on_gpu = dev.type == "cuda"
    thread_note = harness.set_cpu_threads(args.threads, dev)
    interpret = bool(args.interpret) and not on_gpu
    shape = harness.get_shape("tiny-qwen3" if (args.quick or interpret) and args.model == "Qwen3-8B" else args.model)
    batch = args.batch or (shape.recipe_batch if on_gpu else 1)
    seq = args.seq or (16 if (args.quick or interpret) else 4096 if on_gpu else 512)
    repeats = args.repeats or (3 if args.quick else 15)
    regions = [r for r in args.regions.split(",") if r]
    wanted = [i for i in args.impls.split(",") if i]
    env = harness.environment(dev)
    print(f"# bench_ops: {shape.name} widths, batch {batch} x seq {seq} tokens, profile {PROFILE}")
    print(f"# device: {env['device']}; torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    if thread_note:
        print(f"# {thread_note}")

    skipped = {i: availability(i, dev, interpret) for i in wanted}
    for impl, why in skipped.items():
        if why:
            print(f"# {impl}: skipped: {why}")
    impls = [i for i in wanted if not skipped[i]]
    rows: list[dict] = []
    for region in tqdm(regions, desc="regions", disable=not sys.stderr.isatty()):
        case = build_case(region, shape, batch, seq, dev, impls)
        rows += bench_case(case, wanted, skipped, dev, batch * seq, args.warmup, repeats, interpret)
    return rows, env, dict(model=shape.name, batch=batch, seq=seq, profile=PROFILE, repeats=repeats, quick=args.quick)


def bench_case(
    case: Case,
    wanted: list[str],
    skipped: dict,
    dev: torch.device,
    tokens: int,
    warmup: int,
    repeats: int,
    interpret: bool,
) -> list[dict]:
    """Time and size every implementation of one region; rows in the order of `wanted`."""
    runnable = {}
    for impl in case.impls:
        try:  # one call first: an implementation that cannot run here is reported, not fatal
            case.fwd_bwd(impl)
            runnable[impl] = None
        except Exception as exc:  # noqa: BLE001 - reported in the table
            runnable[impl] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    ok = [i for i, err in runnable.items() if err is None]
    if dev.type == "cuda":
        fwd = {i: harness.do_bench_ms(lambda i=i: case.forward(i)) for i in ok}
        fb = {i: harness.do_bench_ms(lambda i=i: case.fwd_bwd(i)) for i in ok}
        fwd_ratio = {i: fwd[i] / fwd["hf"] for i in ok} if "hf" in ok else {}
        fb_ratio = {i: fb[i] / fb["hf"] for i in ok} if "hf" in ok else {}
        timing, wall_fb = "triton.testing.do_bench median (ms)", {}
    else:
        clock = harness.primary_clock(dev)
        tf = harness.time_interleaved(
            {i: (lambda i=i: case.forward(i)) for i in ok}, dev, warmup=warmup, repeats=repeats
        )
        tb = harness.time_interleaved(
            {i: (lambda i=i: case.fwd_bwd(i)) for i in ok}, dev, warmup=warmup, repeats=repeats
        )
        fwd = {i: 1e3 * harness.median(tf[i][clock]) for i in ok}
        fb = {i: 1e3 * harness.median(tb[i][clock]) for i in ok}
        fwd_ratio = {i: harness.paired_ratio(tf[i][clock], tf["hf"][clock]) for i in ok} if "hf" in ok else {}
        fb_ratio = {i: harness.paired_ratio(tb[i][clock], tb["hf"][clock]) for i in ok} if "hf" in ok else {}
        wall_fb = {i: 1e3 * harness.median(tb[i]["wall"]) for i in ok}
        timing = f"process CPU time ({torch.get_num_threads()} torch threads), median of {repeats} interleaved rounds"
    rows = []
    for impl in wanted:
        row = {"region": case.region, "impl": impl, "shape": case.note, "tokens": tokens}
        if impl not in ok:
            row["note"] = "skipped (see header)" if skipped.get(impl) else f"skipped: {runnable.get(impl)}"
            row["skip_reason"] = skipped.get(impl) or runnable.get(impl)
            rows.append(row)
            continue
        mem = harness.measure_memory(lambda i=impl: case.forward(i), lambda o, i=impl: case.backward(i, o), dev)
        row.update(
            fwd_ms=round(fwd[impl], 4),
            fwd_bwd_ms=round(fb[impl], 4),
            fwd_vs_hf=round(fwd_ratio[impl], 3) if impl in fwd_ratio else None,
            fwd_bwd_vs_hf=round(fb_ratio[impl], 3) if impl in fb_ratio else None,
            peak_mib=round(mem["peak"] / harness.MiB, 2),
            held_mib=round(mem["held"] / harness.MiB, 2),
            saved_mib=round(mem["saved"] / harness.MiB, 2),
            timing=timing,
            wall_fwd_bwd_ms=round(wall_fb[impl], 4) if impl in wall_fb else None,
            note="Triton interpreter: not a speed" if interpret and impl in ("triton", "liger") else "",
        )
        rows.append(row)
    return rows


COLUMNS = [
    ("region", "region"),
    ("impl", "impl"),
    ("fwd_ms", "fwd ms"),
    ("fwd_vs_hf", "fwd / hf"),
    ("fwd_bwd_ms", "fwd+bwd ms"),
    ("fwd_bwd_vs_hf", "fwd+bwd / hf"),
    ("peak_mib", "peak MiB"),
    ("held_mib", "held MiB"),
    ("saved_mib", "saved MiB"),
    ("note", "note"),
]


def verdict(rows: list[dict]) -> list[str]:
    """The GPU target: every aligned Triton region at least as fast as HF eager's and no more activation memory."""
    lines = []
    by = {(r["region"], r["impl"]): r for r in rows}
    for region in dict.fromkeys(r["region"] for r in rows):
        t, h = by.get((region, "triton")), by.get((region, "hf"))
        if not t or not h or t.get("fwd_bwd_ms") is None or h.get("fwd_bwd_ms") is None:
            continue
        fast = t["fwd_bwd_ms"] <= h["fwd_bwd_ms"] and t["fwd_ms"] <= h["fwd_ms"]
        lean = t["held_mib"] <= h["held_mib"]
        lines.append(
            f"{region}: triton {'meets' if fast else 'MISSES'} the speed target "
            f"(fwd+bwd x{t['fwd_bwd_vs_hf']:.2f} of hf) and {'meets' if lean else 'MISSES'} the memory target "
            f"(held {t['held_mib']:.1f} vs {h['held_mib']:.1f} MiB)"
        )
    return lines


def main(args: argparse.Namespace) -> int:
    rows, env, settings = run(args)
    print()
    print(harness.format_table(rows, COLUMNS))
    if env["device_type"] == "cuda":
        for line in verdict(rows):
            print("# " + line)
    if not args.no_save:
        paths = harness.append_results("bench_ops", env, settings, rows, args.out)
        print(f"# appended to {paths['json']} and {paths['csv']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
