"""Qwen3-MoE: Qwen3's attention (qk-norm, no biases) with sparse MoE MLPs of their own width.

Layer i is MoE unless it is in ``mlp_only_layers``, and where ``(i + 1) % decoder_sparse_step``
is 0 (HF's ``Qwen3MoeDecoderLayer``); the others are dense MLPs of ``intermediate_size``, the
experts ``moe_intermediate_size`` wide: any such pattern scans (``models/layout.py``). The router
is a softmax over every expert, top-k, renormalised when ``norm_topk_prob``.

HF drops no token and has no router z-loss (the family's ``execution``, as Mixtral's). The
load-balancing loss is HF's formula with its ``router_aux_loss_coef``; HF adds it only when asked
(``output_router_logits``, a switch of the forward pass, false in the published configs),
shardzoo whenever it trains (set ``router_aux_loss_coef=0`` for HF's default). shardzoo adds each
MoE layer's loss, where HF pools the counts and probabilities of all layers before one product:
equal with one MoE layer.
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, MOE
from shardzoo.models.hf import llama, mixtral, qwen3
from shardzoo.models.hf.base import Family, HFConfig
from shardzoo.models.moe_arch import NO_MOE

SCHEMA = ({k: v for k, v in qwen3.SCHEMA.items() if k not in ("max_window_layers", "layer_types", "head_dim")}
          | dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_key_value_heads=4,
                 sliding_window=4096, decoder_sparse_step=1, mlp_only_layers=None, moe_intermediate_size=768,
                 norm_topk_prob=False, num_experts_per_tok=8, num_experts=128, output_router_logits=False,
                 router_aux_loss_coef=0.001))
FEATURES = (qwen3.FEATURES - {"layer_pattern"}) | {"moe", "moe_pattern", "expert_width"}


def from_hf(hf: HFConfig) -> dict:
    bias = hf.get("attention_bias")
    window, use = hf.get("sliding_window"), hf.get("use_sliding_window")
    window = window if use else None  # every layer's; transformers drops it when off
    n, step = hf.get("num_hidden_layers"), hf.get("decoder_sparse_step")
    dense = set(hf.get("mlp_only_layers") or ())
    experts = hf.get("num_experts", None) or hf.get("num_local_experts", None) or hf.family.schema["num_experts"]
    return llama.rotary_fields(hf) | dict(
        qk_norm="head", attention_bias=bias, attention_out_bias=bias, sliding_window=window,
        num_local_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok"),
        moe_intermediate_size=hf.get("moe_intermediate_size"), norm_topk_prob=hf.get("norm_topk_prob"),
        router_aux_loss_coef=hf.get("router_aux_loss_coef"),
        mlp_layer_types=tuple(MOE if (i + 1) % step == 0 and i not in dense else DENSE for i in range(n)))


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    kinds = a.layer_specs()
    return llama.rotary_to_hf(a) | dict(
        attention_bias=a.attention_bias, use_sliding_window=a.sliding_window is not None,
        sliding_window=a.sliding_window, num_experts=m.num_local_experts,
        num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=a.expert_size,
        decoder_sparse_step=1, mlp_only_layers=[i for i, s in enumerate(kinds) if s.mlp == DENSE],
        norm_topk_prob=m.norm_topk_prob, router_aux_loss_coef=m.router_aux_loss_coef)


def layer_weights(a, spec):
    """Qwen3's dense layers; a MoE layer's router ``mlp.gate`` and experts ``mlp.experts.E.*``."""
    if spec.mlp == MOE:
        return llama.attention_weights(a) + mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj"))
    return llama.layer_weights(a, spec)


# Qwen3-MoE (Qwen/Qwen3-30B-A3B/config.json): Qwen3's attention, 128 experts top-8 of their own
# width, renormalised top-k; HF's router has no z-loss.
BASE = qwen3.BASE | dict(num_key_value_heads=4, num_local_experts=128, num_experts_per_tok=8,
                         norm_topk_prob=True, router_aux_loss_coef=0.001, router_z_loss_coef=0.0)
QWEN3_MOE = Family(
    "qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={
        "qwen3-30b-a3b": BASE | dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                     num_attention_heads=32, moe_intermediate_size=768),
        # one dense layer (layer 0, as mlp_only_layers says) and one MoE layer
        "qwen3-moe-tiny": BASE | llama.TINY | dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=64, mlp_layer_types=("dense", "moe")),
    })
