"""Mixtral: Llama's attention (no biases) with a sparse MoE in every layer.

HF's Mixtral has no router z-loss and drops no token: the import sets ``router_z_loss_coef=0``
and ``moe_dispatch="dropless"``, the two training knobs config.json has no field for.
"""

from __future__ import annotations

from shardzoo.models.hf.base import Family, Weight, mismatches
from shardzoo.models.hf.llama import (
    LAYER,
    attention_weights,
    global_weights,
    rotary_fields,
    rotary_obstacles,
    rotary_to_hf,
)
from shardzoo.models.transformer import TransformerConfig


def from_hf(hf: dict, where: str) -> dict:
    return rotary_fields(hf, where) | dict(
        num_local_experts=hf.get("num_local_experts", 8),
        num_experts_per_tok=hf.get("num_experts_per_tok", 2),
        router_jitter_noise=hf.get("router_jitter_noise", 0.0),
        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001), router_z_loss_coef=0.0,
        moe_dispatch="dropless", norm_topk_prob=True,
    )


def to_hf(c) -> dict:
    return rotary_to_hf(c) | dict(
        num_local_experts=c.num_local_experts, num_experts_per_tok=c.num_experts_per_tok,
        router_jitter_noise=c.router_jitter_noise, router_aux_loss_coef=c.router_aux_loss_coef,
    )


def obstacles(c) -> list[str]:
    need = dict(moe_layer_freq=1, mlp_only_layers=(), moe_intermediate_size=None, norm_topk_prob=True,
                attention_bias=False, attention_out_bias=False)
    return rotary_obstacles(c, experts=True) + mismatches(c, need)


def weights(c):
    """(global, dense layer, MoE layer): every Mixtral layer is MoE, so a dense layer (only
    from an override such as ``moe_layer_freq``) maps its attention and nothing else."""
    attn, e, x = attention_weights(c), c.num_local_experts, LAYER + "block_sparse_moe."
    moe = attn + [Weight(("moe", "router", "kernel"), x + "gate.weight", "linear"),
                  Weight(("moe", "wi_gate"), x + "experts.{e}.w1.weight", "linear", experts=e),
                  Weight(("moe", "wi_up"), x + "experts.{e}.w3.weight", "linear", experts=e),
                  Weight(("moe", "wo"), x + "experts.{e}.w2.weight", "linear", experts=e)]
    return global_weights(c), attn, moe


MIXTRAL = Family("mixtral", ("mixtral",), "MixtralForCausalLM", TransformerConfig,
                 from_hf, to_hf, obstacles, weights)
