"""MiniCPM5-MoE (OpenBMB): Llama's attention with full rotate-half rotary and its output times
the sigmoid of a gate that ``q_proj`` projects beside each query head (Qwen3-Next's output
gate, models/hf/qwen3_next.py, without its qk-norm), and DeepSeek-V3's MoE with GLM-4.5's tensors
(models/hf/glm4_moe.py: the sigmoid router with its correction bias and groups, scaled weights,
``n_shared_experts`` shared ones) where ``mlp_layer_types`` says "sparse" (by default all but the
first ``first_k_dense_replace``, 1).
"""

from __future__ import annotations

from shardzoo.models.hf import deepseek_v2, glm4_moe, glm4_moe_lite, llama, mixtral, qwen3_next
from shardzoo.models.hf.base import Family, HFConfig, Weight
from shardzoo.models.moe_arch import NO_MOE

# MiniCPM5MoeConfig's fields and defaults (transformers 5.25), and first_k_dense_replace, which it
# reads when mlp_layer_types is absent
SCHEMA = {k: v for k, v in glm4_moe.SCHEMA.items() if k not in ("use_qk_norm", "num_nextn_predict_layers")} | dict(
    vocab_size=130560, hidden_size=2048, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=32,
    num_key_value_heads=2, max_position_embeddings=524288, rms_norm_eps=1e-6, moe_intermediate_size=512,
    num_experts_per_tok=16, n_routed_experts=160, routed_scaling_factor=3.66, bos_token_id=0, eos_token_id=[1, 130073],
    pad_token_id=1, head_dim=128, mlp_layer_types=None, first_k_dense_replace=1)
FEATURES = llama.ROTARY | {"attention_bias", "attention_out_bias", "attention_output_gate", "moe", "moe_pattern",
                           "expert_width", "shared_experts", "routed_scaling", "sigmoid_router"}


def from_hf(hf: HFConfig) -> dict:
    bias = hf.get("attention_bias")
    return llama.rotary_fields(hf, theta=5e6) | deepseek_v2.moe_fields(hf) | dict(
        mlp_layer_types=glm4_moe_lite.mlp_kinds(hf, hf.get("first_k_dense_replace")), attention_bias=bias,
        attention_out_bias=bias, attn_output_gate=True, router_kind="sigmoid_groups",
        norm_topk_prob=hf.get("norm_topk_prob"), router_aux_loss_coef=0.0)


def to_hf(a) -> dict:
    """Llama's attention and DeepSeek-V3's MoE; no pad id unless the imported config.json had one (the architecture records none,
    and transformers' default, 1, is a token of the vocabulary)."""
    m = a.moe or NO_MOE
    return llama.rotary_to_hf(a) | deepseek_v2.moe_to_hf(a) | dict(
        mlp_layer_types=glm4_moe_lite.mlp_kinds_to_hf(a), attention_bias=a.attention_bias,
        norm_topk_prob=m.norm_topk_prob, pad_token_id=None)


def layer_weights(a, spec) -> list[Weight]:
    """GLM-4.5's norms and MLPs; Qwen3-Next's gated attention (its checkpoints' ``q_proj``, which
    transformers loads as ``q_gate_proj``), no qk-norm."""
    return [w for w in glm4_moe.layer_weights(a, spec) if w.path[0] != "attn"] + [
        w for w in qwen3_next.attention_weights(a) if not w.path[1].endswith("_norm")]


MINICPM5_MOE = Family(
    "minicpm5_moe", ("minicpm5_moe",), "MiniCPM5MoeForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"minicpm5-moe-tiny": glm4_moe.TINY | dict(
        partial_rotary_factor=1.0, qk_norm="none", attention_bias=False, attn_output_gate=True, rope_theta=5e6)})
