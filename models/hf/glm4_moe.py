"""GLM-4.5 (and GLM-4.5-Air, GLM-4.6, GLM-4.7): Llama's attention with q/k/v biases, rotary
embeddings on the first ``partial_rotary_factor`` of each head (0.5 when config.json names
none; rotate-half, not GLM's interleaved pairs), optionally an RMSNorm of each query and key
head before the rotation (``use_qk_norm``), and DeepSeek-V3's MoE after
``first_k_dense_replace`` dense layers.

The MoE layer (``models/hf/deepseek_v3.py``'s, with the same tensors): a sigmoid router whose
choice adds ``e_score_correction_bias`` and keeps the ``topk_group`` best of ``n_group`` groups
(ranked by their two best biased scores), the weights the unbiased scores, renormalised with
``norm_topk_prob``, times ``routed_scaling_factor``; beside the routed experts
``n_shared_experts`` shared ones as one MLP. transformers has no load-balancing loss for it
(``router_aux_loss_coef`` 0), drops no token, and builds no multi-token-prediction layer for
the causal LM (``num_nextn_predict_layers``: the checkpoint's extra layer is not read). The
published configs' ``topk_method`` ("noaux_tc") and ``scoring_func`` ("sigmoid") are fields
transformers' config class does not have; its router is that one whatever they say.
Glm4MoeConfig has no ``head_dim``; transformers reads one from config.json all the same.
"""

from __future__ import annotations

from shardzoo.models.arch import MOE
from shardzoo.models.hf import deepseek_v2, glm, llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig, Weight
from shardzoo.models.moe_arch import NO_MOE

# Glm4MoeConfig's fields and transformers' defaults (num_mtp_layers as config.json spells it)
SCHEMA = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
              num_attention_heads=96, num_key_value_heads=8, hidden_act="silu", max_position_embeddings=131072,
              initializer_range=0.02, rms_norm_eps=1e-5, use_cache=True, tie_word_embeddings=False,
              rope_parameters=None, attention_bias=False, attention_dropout=0.0, moe_intermediate_size=1408,
              num_experts_per_tok=8, output_router_logits=False, n_shared_experts=1, n_routed_experts=128,
              routed_scaling_factor=1.0, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
              use_qk_norm=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              num_nextn_predict_layers=1)
FEATURES = llama.ROTARY | {"partial_rotary", "attention_bias", "qk_norm_head", "moe", "moe_pattern",
                           "expert_width", "shared_experts", "routed_scaling", "sigmoid_router"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore("num_nextn_predict_layers")
    return glm.glm_sizes(hf) | deepseek_v2.moe_fields(hf) | dict(
        attention_bias=hf.get("attention_bias"), qk_norm="head" if hf.get("use_qk_norm") else "none",
        router_kind="sigmoid_groups", norm_topk_prob=hf.get("norm_topk_prob"), router_aux_loss_coef=0.0)


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    return glm.glm_sizes_to_hf(a) | deepseek_v2.moe_to_hf(a) | dict(
        attention_bias=a.attention_bias, use_qk_norm=a.qk_norm == "head", norm_topk_prob=m.norm_topk_prob)


def layer_weights(a, spec) -> list[Weight]:
    """Dense layers: Llama's; MoE layers: ``mlp.gate`` (and its ``e_score_correction_bias``),
    ``mlp.experts.E.*`` and ``mlp.shared_experts.*``."""
    if spec.mlp != MOE:
        return llama.layer_weights(a, spec)
    h = llama.LAYER + "mlp."
    out = llama.attention_weights(a) + mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj"))
    if a.moe.shared_expert_intermediate_size:
        out += [Weight(("shared_expert", n, "kernel"), h + f"shared_experts.{n}_proj.weight", "linear")
                for n in ("gate", "up", "down")]
    return out + [Weight(("moe", "router_bias"), h + "gate.e_score_correction_bias")]


_ROUTING = dict(router_kind="sigmoid_groups", norm_topk_prob=True, router_aux_loss_coef=0.0,
                router_z_loss_coef=0.0, partial_rotary_factor=0.5, attention_bias=True)
# zai-org/GLM-4.5-Air/config.json: 46 layers, the first dense, 128 experts top-8 (one group) and
# one shared, 1408 wide; 96 heads of 128 (wider than the 4096 hidden), no qk-norm.
AIR = _ROUTING | dict(
    vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1000000.0,
    num_local_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408, shared_expert_intermediate_size=1408,
    n_group=1, topk_group=1, routed_scaling_factor=1.0, mlp_layer_types=("dense",) + ("moe",) * 45,
    bos_token_id=None, eos_token_id=tuple(glm.GLM_EOS))
# a dense layer, then two MoE layers (scanned); qk-norm, four groups of two experts (two kept)
TINY = _ROUTING | llama.TINY | dict(
    num_hidden_layers=3, qk_norm="head", num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    mlp_layer_types=("dense", "moe", "moe"))
GLM4_MOE = Family(
    "glm4_moe", ("glm4_moe",), "Glm4MoeForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"glm-4.5-air": AIR, "glm4-moe-tiny": TINY})
