"""Reading Inductor's generated C++ of a compiled engine: the reduction lanes of every RMSNorm, in forward order."""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

from .layout import EngineInfo, cpu_vector_isa, engine_info

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


def _inductor_dir_of(llm_or_dir) -> tuple[str, EngineInfo | None]:
    if isinstance(llm_or_dir, (str, os.PathLike)):
        return str(llm_or_dir), None
    info = engine_info(llm_or_dir)
    if not info.compiled:
        raise ValueError("This engine has no compiled graph: it is not compiled (enforce_eager?).")
    path = info.inductor_dir or info.cache_dir
    if not path:
        raise ValueError("This engine's compile cache is unknown: build it with trl_roundalign.engine.build.build_llm.")
    return path, info


def inductor_reduction_lanes(llm_or_cache_dir, *, num_layers: int | None = None) -> list[int]:
    """Lane count of every RMSNorm reduction the engine's compiled model runs, in forward order.

    Read from the C++ Inductor generated for this engine (its compile cache), checked against this
    machine's vector width. For the decoder models we patch each reduction is one RMSNorm (input norm,
    Qwen3's q/k norms, post-attention norm, ..., final norm), in the order the forward runs them.

    - One-graph engine (vLLM-CPU default): the model is the newest generated module (the last compile's).
    - Piecewise engine (graph split at attention): one module per piece; the first piece holds the
      embedding, the last holds no RoPE, and the middle pieces (one per layer boundary) share one
      generated module, which is repeated `num_layers - 1` times. Middle modules that differ raise.

    Args:
        llm_or_cache_dir: a built compiled `vllm.LLM` (from `build_llm` or TRL colocate) or an Inductor
            cache folder.
        num_layers: decoder layers (read from the engine when an `LLM` is given; needed for a piecewise
            cache folder).

    Raises:
        FileNotFoundError: no Inductor C++ model graph in the cache.
        ValueError: code for another ISA, or pieces this reader cannot order.
    """
    path, info = _inductor_dir_of(llm_or_cache_dir)
    isa = cpu_vector_isa()
    vector_floats = isa[1] if isa else None
    modules = _inductor_modules(path)
    if not modules:
        raise FileNotFoundError(
            f"No Inductor C++ model graph found under {path}: the engine is not compiled with Inductor's C++ backend "
            "(the exact reduction order is read from vLLM-CPU's compile cache)."
        )
    piecewise = info.piecewise if info is not None else len(modules) > 1 and num_layers is not None
    if not piecewise:
        src = modules[-1]  # the last compile's (the model's graph: one module per compile)
        return EngineLanes(_module_lanes(src, vector_floats), embedding_kernels=_embedding_kernels(src))
    if num_layers is None:
        num_layers = int(llm_or_cache_dir.llm_engine.model_config.hf_config.num_hidden_layers)
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
