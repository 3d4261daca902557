"""Phi-3 (mini 4k): Llama's model with fused tensors: ``self_attn.qkv_proj`` (q | k | v rows,
unequal under GQA) and ``mlp.gate_up_proj`` (gate | up), split on import and joined on export.
``longrope`` rope scaling (the 128k models) is refused by ``base.rope`` as unsupported."""

from __future__ import annotations

from shardzoo.models.hf.base import Family, Weight, mismatches
from shardzoo.models.hf.llama import (
    LAYER,
    NO_BIAS,
    global_weights,
    rotary_fields,
    rotary_obstacles,
    rotary_to_hf,
)
from shardzoo.models.transformer import TransformerConfig


def from_hf(hf: dict, where: str) -> dict:
    return rotary_fields(hf, where)


def to_hf(c) -> dict:
    # Phi-3 pads with its end-of-text token (32000 both, published); transformers' default pad
    # id 32000 would not fit a smaller vocabulary.
    eos = c.eos_token_id[0] if isinstance(c.eos_token_id, tuple) else c.eos_token_id
    return rotary_to_hf(c) | dict(original_max_position_embeddings=c.max_position_embeddings,
                                  pad_token_id=eos)


def obstacles(c) -> list[str]:
    return rotary_obstacles(c) + mismatches(c, NO_BIAS)


def weights(c):
    """(global, dense layer, MoE layer); q, k, v and gate, up are column blocks of fused tensors."""
    h, heads = LAYER, (c.num_attention_heads, c.kv_heads, c.kv_heads)
    layer = [Weight(("attn_norm", "scale"), h + "input_layernorm.weight"),
             Weight(("mlp_norm", "scale"), h + "post_attention_layernorm.weight"),
             Weight(("attn", "o", "kernel"), h + "self_attn.o_proj.weight", "linear", n_in=2),
             Weight(("mlp", "down", "kernel"), h + "mlp.down_proj.weight", "linear")]
    layer += [Weight(("attn", n, "kernel"), h + "self_attn.qkv_proj.weight", "linear",
                     part=(j, 3), widths=heads) for j, n in enumerate("qkv")]
    layer += [Weight(("mlp", n, "kernel"), h + "mlp.gate_up_proj.weight", "linear", part=(j, 2))
              for j, n in enumerate(("gate", "up"))]
    return global_weights(c), layer, []


PHI3 = Family("phi3", ("phi3",), "Phi3ForCausalLM", TransformerConfig,
              from_hf, to_hf, obstacles, weights)
