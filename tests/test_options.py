"""TRL options: each refusal is one line naming what to change, raised before anything loads; the accepted
neighbour of each is accepted; sampling options that bias the distribution are warned about with the key named."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from trl_roundalign import RoundAlignGRPOConfig
from trl_roundalign.local_models import tiny_model
from trl_roundalign.trainer.options import check_options, sampling_biases


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", report_to="none", use_cpu=True, bf16=True)
    base.update(kw)
    return RoundAlignGRPOConfig(**base)


def _refused(model, args, says: str):
    with pytest.raises(ValueError) as err:
        check_options(model, args)
    msg = str(err.value)
    assert says in msg and "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def qwen3():
    return str(tiny_model("qwen3"))


def test_the_plain_recipe_is_accepted_without_a_word(tmp_path, qwen3):
    args = _args(tmp_path)  # (the config's own setup may warn about the environment, e.g. accelerate's OMP note)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_options(qwen3, args)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"generation_kwargs": {"temperature": 0.7}}, "Set temperature=0.7 in the config"),
        ({"generation_kwargs": {"logprobs": 5}}, "Remove 'logprobs' from generation_kwargs"),
        ({"generation_kwargs": {"n": 2}}, "Remove 'n' from generation_kwargs"),
        ({"vllm_enable_sleep_mode": True}, "vLLM-CPU has no sleep mode"),
        ({"vllm_model_impl": "transformers"}, "Set vllm_model_impl='vllm'"),
        ({"fp16": True, "bf16": False}, "Set bf16=True and fp16=False"),
        ({"use_liger_kernel": True}, "use_liger_kernel=True"),
        ({"model_init_kwargs": {"use_kernels": True, "dtype": "bfloat16"}}, "use_kernels"),
        ({"use_vllm": False}, "set use_vllm=True"),
        ({"vllm_tensor_parallel_size": 4}, "Set vllm_tensor_parallel_size=1"),
        ({"vllm_engine_kwargs": {"model_impl": "transformers"}}, "Set vllm_model_impl='vllm'"),
        ({"generation_kwargs": {"prompt_logprobs": 1}}, "Remove 'prompt_logprobs' from generation_kwargs"),
        ({"generation_kwargs": {"logprobs_mode": "raw_logprobs"}}, "Remove 'logprobs_mode' from generation_kwargs"),
        ({"torch_compile": True}, "Set torch_compile=False"),
        ({"neftune_noise_alpha": 5.0}, "Set neftune_noise_alpha=None"),
        ({"model_init_kwargs": {"dtype": "bfloat16", "quantization_config": {"load_in_8bit": True}}}, "quantized policy"),
        ({"model_init_kwargs": {"dtype": "bfloat16", "attn_implementation": "flex_attention"},
          "roundalign_regions": ["rope", "swiglu", "rmsnorm", "attention"]}, "Load with attn_implementation='sdpa'"),
    ],
    ids=["temperature", "logprobs", "n", "sleep-on-cpu", "model-impl", "fp16", "liger", "hub-kernels", "no-vllm", "tp",
         "model-impl-kwargs", "prompt-logprobs", "logprobs-mode", "torch-compile", "neftune", "quantized",
         "flex-attention-exact"],
)
def test_options_that_break_alignment_are_refused_in_one_line(tmp_path, qwen3, options, says):
    _refused(qwen3, _args(tmp_path, **options), says)


@pytest.mark.parametrize(
    "options",
    [
        {"generation_kwargs": {"temperature": 1.0}},
        {"generation_kwargs": {"logprobs": 0, "max_tokens": 16}},
        {"vllm_model_impl": "transformers", "roundalign_regions": []},
        {"use_vllm": False, "roundalign_regions": []},
    ],
    ids=["same-temperature", "logprobs-0", "model-impl-without-alignment", "no-vllm-without-alignment"],
)
def test_their_neighbours_are_accepted(tmp_path, qwen3, options):
    check_options(qwen3, _args(tmp_path, **options))


def test_tied_embeddings_with_an_fp32_head_name_the_fix(tmp_path):
    tied = str(tiny_model("qwen3", tie_word_embeddings=True))
    _refused(tied, _args(tmp_path, cast_lm_head_to_fp32=True), "Set cast_lm_head_to_fp32=False")
    check_options(tied, _args(tmp_path))  # the same model without the cast


def test_dropout_in_the_training_forward_is_refused_unless_disabled(tmp_path):
    dropping = str(tiny_model("qwen3", attention_dropout=0.1))
    _refused(dropping, _args(tmp_path, disable_dropout=False), "Set disable_dropout=True")
    check_options(dropping, _args(tmp_path, disable_dropout=True))


def test_remote_modelling_code_is_refused(tmp_path):
    import json
    import shutil

    remote = tmp_path / "remote"
    shutil.copytree(tiny_model("qwen3"), remote)
    cfg = json.loads((remote / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (remote / "config.json").write_text(json.dumps(cfg))
    _refused(str(remote), _args(tmp_path), "brings its own modelling code")
    check_options(str(remote), _args(tmp_path, roundalign_regions=[]))


def test_a_vision_language_checkpoint_is_refused_as_such(tmp_path):
    from transformers import AutoModelForImageTextToText, Qwen2VLConfig

    cfg = Qwen2VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=512, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, in_chans=3, spatial_patch_size=14),
    )
    path = tmp_path / "vlm"
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(path)
    _refused(str(path), _args(tmp_path), "vision-language checkpoint")


def test_sampling_biases_name_every_key():
    args = RoundAlignGRPOConfig(
        output_dir="/tmp/unused", use_cpu=True, top_p=0.9,
        generation_kwargs={"presence_penalty": 0.5, "logit_bias": {3: 1.0}, "min_tokens": 0, "top_k": -1, "max_tokens": 8},
        vllm_structured_outputs_regex=r"\d+",
    )  # fmt: skip
    assert sampling_biases(args) == [
        "top_p=0.9", "vllm_structured_outputs_regex", "generation_kwargs['presence_penalty']=0.5",
        "generation_kwargs['logit_bias']={3: 1.0}",
    ]  # fmt: skip
    with pytest.warns(UserWarning, match=r"presence_penalty.*do not read mismatch/\*"):
        check_options(str(tiny_model("qwen3")), _args("/tmp/unused", generation_kwargs={"presence_penalty": 0.5}))


@pytest.mark.parametrize(
    ("options", "named"),
    [({"top_k": 20}, "top_k=20"), ({"min_p": 0.05}, "min_p=0.05"), ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
     ({"top_p": 0.9}, "top_p=0.9"), ({"vllm_structured_outputs_regex": r"\d+"}, "vllm_structured_outputs_regex")],
    ids=["top_k", "min_p", "repetition_penalty", "top_p", "structured-outputs"],
)
def test_each_sampling_bias_is_warned_with_its_name(tmp_path, qwen3, options, named):
    with pytest.warns(UserWarning, match=re.escape(named)):
        check_options(qwen3, _args(tmp_path, **options))


def test_a_policy_object_in_fp32_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3"), dtype=torch.float32)
    _refused(model, _args(tmp_path), "The policy was passed in torch.float32")


def test_tf32_is_refused(tmp_path, qwen3):
    """transformers itself refuses tf32=True without an Ampere GPU; set after construction, the package's refusal."""
    args = _args(tmp_path)
    args.tf32 = True
    _refused(qwen3, args, "Set tf32=False")


def test_an_fp32_head_in_server_mode_says_how_to_start_the_server(tmp_path, qwen3):
    """The trainer casts only its own head in server mode: it says which flag gives the server an fp32 head too (the
    run then stops here because no server listens on the port: the warning comes first)."""
    import socket

    from trl_roundalign import RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = _args(tmp_path, vllm_mode="server", vllm_server_base_url=f"http://127.0.0.1:{port}", vllm_server_timeout=1,
                 cast_lm_head_to_fp32=True, roundalign_profile="vllm-compiled")  # fmt: skip
    with pytest.warns(UserWarning, match=r"--hf-overrides '\{\"head_dtype\": \"float32\"\}'"), pytest.raises(ConnectionError, match="can't be reached"):
        RoundAlignGRPOTrainer(model=qwen3, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                              train_dataset=arithmetic_dataset("train[:8]"))  # fmt: skip
