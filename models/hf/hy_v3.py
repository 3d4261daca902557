"""Hunyuan V3 (``hy_v3``): Llama's layer with biases on q/k/v and o by ``attention_bias`` and an
RMSNorm of each query and key head before the rotation (Apertus' and Qwen3's), dense SwiGLU MLPs
where ``mlp_layer_types`` says "dense" (by default the first layer) and MoE elsewhere: sigmoid
scores whose choice adds ``expert_bias`` (DeepSeek-V3's router, one group), renormalised, times
``router_scaling_factor``, beside ``num_shared_experts`` shared experts (``shared_mlp``).
"""

from __future__ import annotations

from shardzoo.models.hf import glm4_moe, glm4_moe_lite, llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig, Weight, renamed
from shardzoo.models.moe_arch import NO_MOE

# HYV3Config's fields and defaults (transformers 5.25)
SCHEMA = {k: v for k, v in llama.SCHEMA.items() if k != "pretraining_tp"} | dict(
    vocab_size=120832, hidden_size=4096, intermediate_size=13312, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, initializer_range=0.006, rms_norm_eps=1e-5,
    bos_token_id=None, eos_token_id=None, num_experts=192, num_experts_per_tok=8, num_shared_experts=1,
    moe_intermediate_size=1536, router_scaling_factor=2.826, enable_moe_fp32_combine=True,
    output_router_logits=False, mlp_layer_types=None)
FEATURES = llama.ROTARY | {"attention_bias", "attention_out_bias", "qk_norm_head", "moe", "moe_pattern",
                           "expert_width", "shared_experts", "routed_scaling", "sigmoid_router"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore("enable_moe_fp32_combine")  # the experts' sum in float32: shardzoo's float32 model sums so
    width, bias = hf.get("moe_intermediate_size"), hf.get("attention_bias")
    return llama.rotary_fields(hf, theta=11158840.0) | dict(
        attention_bias=bias, attention_out_bias=bias, qk_norm="head", mlp_layer_types=glm4_moe_lite.mlp_kinds(hf),
        num_local_experts=hf.get("num_experts"), num_experts_per_tok=hf.get("num_experts_per_tok"),
        moe_intermediate_size=width, shared_expert_intermediate_size=hf.get("num_shared_experts") * width,
        routed_scaling_factor=hf.get("router_scaling_factor"), router_kind="sigmoid_groups", norm_topk_prob=True,
        router_aux_loss_coef=0.0)


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    return llama.rotary_to_hf(a) | dict(
        attention_bias=a.attention_bias, mlp_layer_types=glm4_moe_lite.mlp_kinds_to_hf(a),
        num_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=a.expert_size, num_shared_experts=m.shared_expert_intermediate_size // a.expert_size,
        router_scaling_factor=m.routed_scaling_factor)


# GLM-4.5's MoE tensors (models/hf/glm4_moe.py) -> Hunyuan V3's
_NAMES = (("mlp.gate.e_score_correction_bias", "mlp.expert_bias"), ("mlp.gate.weight", "mlp.router.gate.weight"),
          ("mlp.shared_experts.", "mlp.shared_mlp."))


def layer_weights(a, spec) -> list[Weight]:
    return renamed(glm4_moe.layer_weights(a, spec), _NAMES)


HY_V3 = Family(
    "hy_v3", ("hy_v3",), "HYV3ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, llama.global_weights, layer_weights,
    execution=mixtral.HF_MOE,
    presets={"hy-v3-tiny": glm4_moe.TINY | dict(partial_rotary_factor=1.0, attention_bias=True,
                                                attention_out_bias=True, n_group=1, topk_group=1)})
