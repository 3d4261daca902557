"""Solar Open (Upstage): GLM-4.5's MoE (models/hf/glm4_moe.py: a sigmoid router with its
correction bias and groups, ``routed_scaling_factor``, ``n_shared_experts`` shared experts) in
every layer, under Llama's attention with q/k/v biases by ``attention_bias`` (never on o) and
full rotary embeddings (base 1e6). Its config has no dense width (``intermediate_size``): the
dense MLP shardzoo keeps for an override is as wide as an expert. The same model is GLM-4.5's
with no dense layer and full rotary (an export without the family named writes that).
"""

from __future__ import annotations

from shardzoo.models.hf import glm4_moe, llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig
from shardzoo.models.moe_arch import NO_MOE

# SolarOpenConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=196608, hidden_size=4096, num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=8,
              head_dim=128, hidden_act="silu", max_position_embeddings=131072, initializer_range=0.02,
              rms_norm_eps=1e-5, use_cache=True, tie_word_embeddings=False, rope_parameters=None, attention_bias=False,
              attention_dropout=0.0, moe_intermediate_size=1280, num_experts_per_tok=8, output_router_logits=False,
              n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1,
              norm_topk_prob=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              intermediate_size=None)  # (not SolarOpenConfig's: read for the dense width it lacks)
FEATURES = llama.ROTARY | {"attention_bias", "moe", "expert_width", "shared_experts", "routed_scaling",
                           "sigmoid_router"}


def from_hf(hf: HFConfig) -> dict:
    width = hf.get("moe_intermediate_size")
    return llama.rotary_fields(hf, theta=1e6) | dict(
        intermediate_size=width, moe_intermediate_size=width, num_local_experts=hf.get("n_routed_experts"),
        num_experts_per_tok=hf.get("num_experts_per_tok"), routed_scaling_factor=hf.get("routed_scaling_factor"),
        shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0) * width, n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1, router_kind="sigmoid_groups", norm_topk_prob=hf.get("norm_topk_prob"),
        router_aux_loss_coef=0.0, attention_bias=hf.get("attention_bias"))


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    out = llama.rotary_to_hf(a) | dict(
        moe_intermediate_size=a.expert_size, n_routed_experts=m.num_local_experts,
        num_experts_per_tok=m.num_experts_per_tok, routed_scaling_factor=m.routed_scaling_factor,
        n_shared_experts=m.shared_expert_intermediate_size // a.expert_size, n_group=m.n_group,
        topk_group=m.topk_group, norm_topk_prob=m.norm_topk_prob, attention_bias=a.attention_bias)
    del out["intermediate_size"]
    return out


SOLAR_OPEN = Family(
    "solar_open", ("solar_open",), "SolarOpenForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, glm4_moe.layer_weights, execution=mixtral.HF_MOE,
    presets={"solar-open-tiny": glm4_moe.TINY | dict(
        intermediate_size=32, mlp_layer_types=None, partial_rotary_factor=1.0, qk_norm="none")})
