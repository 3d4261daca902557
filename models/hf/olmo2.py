"""OLMo 2: Llama's tensors with the norms moved onto the outputs (``post_attention_layernorm``
and ``post_feedforward_layernorm``, no pre-norms) and qk-norm over the whole q and k
projections (``q_norm`` of heads x head_dim, ``k_norm`` of kv_heads x head_dim)."""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, mismatches
from shardzoo.models.hf.llama import rotary_fields, rotary_obstacles, rotary_to_hf
from shardzoo.models.transformer import TransformerConfig

FEATURES = dict(norm_position="post", qk_norm="projection")


def from_hf(hf: dict, where: str) -> dict:
    bias = hf.get("attention_bias", False)  # one flag for q/k/v/o
    return rotary_fields(hf, where) | FEATURES | dict(attention_bias=bias, attention_out_bias=bias)


def to_hf(c) -> dict:
    return rotary_to_hf(c) | dict(attention_bias=c.attention_bias)


def obstacles(c) -> list[str]:
    return (rotary_obstacles(c, **FEATURES) + mismatches(c, dict(mlp_bias=False, sliding_window=None))
            + llama.one_attention_bias(c))


def weights(c):
    """Llama's tensors, the post-norms and q_norm, k_norm in place of the pre-norms."""
    return llama.weights(c)


OLMO2 = Family("olmo2", ("olmo2",), "Olmo2ForCausalLM", TransformerConfig,
               from_hf, to_hf, obstacles, weights)
