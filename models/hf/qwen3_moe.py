"""Qwen3-MoE: Qwen3's attention (qk-norm, no biases) with sparse MoE MLPs of their own width.

Layer i is MoE unless it is in ``mlp_only_layers`` and where ``(i + 1) % decoder_sparse_step``
is 0 (HF's ``Qwen3MoeDecoderLayer``; shardzoo's ``moe_layer_freq``); the others are dense
MLPs of ``intermediate_size``, the experts ``moe_intermediate_size`` wide. The router is a
softmax over every expert, top-k, renormalised when ``norm_topk_prob``.

HF drops no token and has no router z-loss: the import sets ``moe_dispatch="dropless"`` and
``router_z_loss_coef=0`` (as for Mixtral). The load-balancing loss is HF's formula with its
``router_aux_loss_coef``; HF adds it only when asked (``output_router_logits``, a switch of the
forward pass, false in the published configs), shardzoo whenever it trains (set
``router_aux_loss_coef=0`` for HF's default). shardzoo adds each MoE layer's loss, where HF pools
the counts and probabilities of all layers before one product: equal with one MoE layer.
"""

from __future__ import annotations

from shardzoo.models.hf import llama, qwen3
from shardzoo.models.hf.base import Family, Weight, mismatches
from shardzoo.models.hf.llama import LAYER, attention_weights
from shardzoo.models.transformer import TransformerConfig


def from_hf(hf: dict, where: str) -> dict:
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    return qwen3.from_hf(hf, where) | dict(
        num_local_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok", 8),
        moe_intermediate_size=hf.get("moe_intermediate_size", 768),
        moe_layer_freq=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        norm_topk_prob=hf.get("norm_topk_prob", False), router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
        router_z_loss_coef=0.0, moe_dispatch="dropless",
    )


def to_hf(c) -> dict:
    return qwen3.to_hf(c) | dict(
        num_experts=c.num_local_experts, num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.expert_size, decoder_sparse_step=c.moe_layer_freq,
        mlp_only_layers=list(c.mlp_only_layers), norm_topk_prob=c.norm_topk_prob,
        router_aux_loss_coef=c.router_aux_loss_coef,
    )


def obstacles(c) -> list[str]:
    bad = llama.rotary_obstacles(c, experts=True, qk_norm="head")
    return bad + mismatches(c, dict(mlp_bias=False, router_jitter_noise=0.0)) + llama.one_attention_bias(c)


def weights(c):
    """Qwen3's dense layers; a MoE layer's router ``mlp.gate`` and experts ``mlp.experts.E.*``."""
    glob, dense, _ = qwen3.weights(c)
    attn, e, x = attention_weights(c), c.num_local_experts, LAYER + "mlp."
    moe = attn + [Weight(("moe", "router", "kernel"), x + "gate.weight", "linear"),
                  Weight(("moe", "wi_gate"), x + "experts.{e}.gate_proj.weight", "linear", experts=e),
                  Weight(("moe", "wi_up"), x + "experts.{e}.up_proj.weight", "linear", experts=e),
                  Weight(("moe", "wo"), x + "experts.{e}.down_proj.weight", "linear", experts=e)]
    return glob, dense, moe


QWEN3_MOE = Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", TransformerConfig,
                   from_hf, to_hf, obstacles, weights)
