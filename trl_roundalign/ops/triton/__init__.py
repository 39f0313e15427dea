"""Triton backends of the aligned regions: one module per op, each with its kernels and its `autograd.Function`.

Import nothing here: the op modules are imported lazily by `trl_roundalign.ops` when `backend="triton"`
is chosen, because `triton.jit` decides at decoration time whether a kernel is compiled for the GPU or
run by the CPU interpreter (`TRITON_INTERPRET=1`).
"""
