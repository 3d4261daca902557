"""Qwen3 (dense): Llama's layout with qk-norm (an RMSNorm of each head's q and k, before rotary)
and no biases (``attention_bias`` is one flag for q/k/v/o); the window as Qwen2's."""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, mismatches
from shardzoo.models.hf.llama import rotary_fields, rotary_obstacles, rotary_to_hf
from shardzoo.models.transformer import TransformerConfig


def from_hf(hf: dict, where: str) -> dict:
    bias = hf.get("attention_bias", False)
    fields = rotary_fields(hf, where, window=hf.get("use_sliding_window", False))
    return fields | dict(qk_norm="head", attention_bias=bias, attention_out_bias=bias)


def to_hf(c) -> dict:
    return rotary_to_hf(c) | dict(attention_bias=c.attention_bias,
                                  use_sliding_window=bool(c.sliding_window), max_window_layers=0)


def obstacles(c) -> list[str]:
    return (rotary_obstacles(c, qk_norm="head") + mismatches(c, dict(mlp_bias=False))
            + llama.one_attention_bias(c))


def weights(c):
    """Llama's tensors plus ``self_attn.q_norm`` and ``k_norm`` (head_dim each)."""
    return llama.weights(c)


QWEN3 = Family("qwen3", ("qwen3",), "Qwen3ForCausalLM", TransformerConfig,
               from_hf, to_hf, obstacles, weights)
