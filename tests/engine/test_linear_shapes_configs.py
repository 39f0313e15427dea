"""`engine.gemm.linear_shapes` reads every family's config as transformers 5.19 builds it: that release gives every
config a `per_layer_config` view, and a Qwen2 config's has no per-layer head dim (reading it raised; the GEMM schedule
measured on the Intel Xeon AVX-512 machine then failed every tiny-qwen2 engine). No engine: configs only."""

from __future__ import annotations

from transformers import Qwen2Config, Qwen3Config

from trl_roundalign.engine.gemm import linear_shapes


def test_a_config_without_a_head_dim_field_uses_hidden_over_heads():
    cfg = Qwen2Config(num_hidden_layers=2, hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=160, vocab_size=512)
    shapes = linear_shapes(cfg)
    assert shapes["qkv_proj"] == (96, 96, 48, 48)
    assert shapes["down_proj"] == (160, 96)


def test_a_config_with_a_head_dim_field_keeps_it():
    cfg = Qwen3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=128, vocab_size=512)
    assert linear_shapes(cfg)["qkv_proj"] == (64, 128, 64, 64)
