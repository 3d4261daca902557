"""OLMoE: OLMo 2's qk-norm over the whole q and k projections, with Llama's pre-norms and a
sparse MoE in every layer (experts ``intermediate_size`` wide; router ``mlp.gate``, experts
``mlp.experts.E.{gate,up,down}_proj`` on disk).

The router is a softmax over every expert, top-k, renormalised when ``norm_topk_prob``; HF
drops no token and has no router z-loss (the family's ``execution``, as Mixtral's). One flag,
``attention_bias``, for q/k/v/o biases. ``clip_qkv`` (clamping q, k and v) is not implemented:
a config that sets it is refused by the generic check.
"""

from __future__ import annotations

from shardzoo.models.arch import MOE
from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig
from shardzoo.models.moe_arch import NO_MOE

# OlmoeConfig's fields and defaults (transformers 5)
SCHEMA = ({k: v for k, v in llama.SCHEMA.items() if k not in ("mlp_bias", "pretraining_tp", "head_dim")}
          | dict(vocab_size=50304, hidden_size=2048, intermediate_size=2048, num_hidden_layers=16,
                 num_attention_heads=16, max_position_embeddings=4096, rms_norm_eps=1e-5, pad_token_id=1,
                 bos_token_id=None, eos_token_id=50279, clip_qkv=None, num_experts_per_tok=8, num_experts=64,
                 output_router_logits=False, router_aux_loss_coef=0.01, norm_topk_prob=False))
FEATURES = llama.ROTARY | {"qk_norm_projection", "attention_bias", "attention_out_bias", "moe"}


def from_hf(hf: HFConfig) -> dict:
    bias = hf.get("attention_bias")  # one flag for q/k/v/o
    experts = hf.get("num_experts", None) or hf.get("num_local_experts", None) or hf.family.schema["num_experts"]
    return llama.rotary_fields(hf) | dict(
        qk_norm="projection", attention_bias=bias, attention_out_bias=bias, num_local_experts=experts,
        num_experts_per_tok=hf.get("num_experts_per_tok"), norm_topk_prob=hf.get("norm_topk_prob"),
        router_aux_loss_coef=hf.get("router_aux_loss_coef"))


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    out = llama.rotary_to_hf(a) | dict(
        attention_bias=a.attention_bias, num_experts=m.num_local_experts,
        num_experts_per_tok=m.num_experts_per_tok, norm_topk_prob=m.norm_topk_prob,
        router_aux_loss_coef=m.router_aux_loss_coef)
    del out["head_dim"]  # OlmoeConfig has none: hidden_size // num_attention_heads
    return out


def layer_weights(a, spec):
    """Every OLMoE layer is MoE (a dense one only from an override: Llama's MLP names)."""
    if spec.mlp == MOE:
        return llama.attention_weights(a) + mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj"))
    return llama.layer_weights(a, spec)


# allenai/OLMoE-1B-7B-0924/config.json: 64 experts top-8, not renormalised, qk-norm.
BASE = dict(vocab_size=50304, rms_norm_eps=1e-5, qk_norm="projection", num_local_experts=64,
            num_experts_per_tok=8, norm_topk_prob=False, router_aux_loss_coef=0.01, router_z_loss_coef=0.0,
            bos_token_id=None, eos_token_id=50279)
OLMOE = Family(
    "olmoe", ("olmoe",), "OlmoeForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={
        "olmoe-1b-7b": BASE | dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                                   num_attention_heads=16, max_position_embeddings=4096),
        "olmoe-tiny": BASE | llama.TINY | dict(num_local_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    })
