"""Rounding-aligned regions: Triton kernels (forward and backward) and exact PyTorch references.

Each function takes `profile=` (a name from `trl_roundalign.profiles.PROFILES`) and `backend=`
(`"triton"`, `"torch"`, or `None`: Triton on CUDA tensors, the PyTorch reference elsewhere). The
rounding contract each implements is stated in its module docstring and in docs/numerics.md. Gemma 3's forms
(`gemma.py`) run the PyTorch reference on every device.
"""

from .gemma import geglu_tanh, gemma_qk_norm_rope, gemma_rms_norm
from .gemma4 import gemma4_per_layer_inputs, gemma4_qk_norm_rope, gemma4_rms_norm
from .rms_norm import add_rms_norm, rms_norm
from .rope import qk_norm_rope, rope
from .swiglu import sigmoid_gate, swiglu

__all__ = [
    "add_rms_norm", "geglu_tanh", "gemma4_per_layer_inputs", "gemma4_qk_norm_rope", "gemma4_rms_norm",
    "gemma_qk_norm_rope", "gemma_rms_norm", "qk_norm_rope", "rms_norm", "rope", "sigmoid_gate", "swiglu",
]
