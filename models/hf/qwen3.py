"""Qwen3 (dense): Llama's layout with qk-norm (an RMSNorm of each head's q and k, before rotary)
and no biases (``attention_bias`` is one flag for q/k/v/o); the window as Qwen2's."""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig

SCHEMA = llama.QWEN2_SCHEMA | dict(head_dim=128, attention_bias=False)
FEATURES = llama.ROTARY | {"qk_norm_head", "attention_bias", "attention_out_bias", "sliding_window",
                           "layer_pattern"}


def from_hf(hf: HFConfig) -> dict:
    bias = hf.get("attention_bias")
    return (llama.rotary_fields(hf) | llama.qwen2_window(hf)
            | dict(qk_norm="head", attention_bias=bias, attention_out_bias=bias))


def to_hf(a) -> dict:
    return llama.rotary_to_hf(a) | llama.qwen2_window_to_hf(a) | dict(attention_bias=a.attention_bias)


# Qwen3 (Qwen/Qwen3-*/config.json): head_dim 128 whatever the width, qk-norm, no biases.
BASE = dict(vocab_size=151936, head_dim=128, num_key_value_heads=8, max_position_embeddings=40960,
            rope_theta=1000000.0, qk_norm="head", bos_token_id=151643, eos_token_id=151645)
QWEN3 = Family(
    "qwen3", ("qwen3",), "Qwen3ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, llama.layer_weights,  # plus self_attn.q_norm and k_norm (head_dim each)
    presets={
        "qwen3-0.6b": BASE | dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                  num_attention_heads=16, tie_word_embeddings=True),
        "qwen3-8b": BASE | dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                num_attention_heads=32),
        "qwen3-tiny": BASE | llama.TINY | dict(head_dim=32, tie_word_embeddings=True),
    })
