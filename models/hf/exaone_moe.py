"""EXAONE-MoE (K-EXAONE): EXAONE 4's attention (models/hf/exaone4.py: qk-norm of each head,
sliding and full layers, no rotary embedding on the full layers of a model with a window) under
pre-norms (OLMoE's layer), and DeepSeek-V3's MoE (GLM-4.5's tensors, models/hf/glm4_moe.py: the
sigmoid router with its correction bias, here ``mlp.e_score_correction_bias``, and groups,
``routed_scaling_factor``, ``num_shared_experts`` shared ones) on the layers ``mlp_layer_types``
calls "sparse" (by default all but the first ``first_k_dense_replace``).
"""

from __future__ import annotations

from shardzoo.models.hf import exaone4, glm4_moe, glm4_moe_lite, llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig, renamed
from shardzoo.models.moe_arch import NO_MOE

# ExaoneMoeConfig's fields and defaults (transformers 5.25)
SCHEMA = exaone4.SCHEMA | dict(
    eos_token_id=53, pad_token_id=0, bos_token_id=1, mlp_layer_types=None, first_k_dense_replace=1,
    moe_intermediate_size=1024, num_experts=64, num_experts_per_tok=8, output_router_logits=False,
    num_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=1, topk_group=1)
FEATURES = (exaone4.FEATURES - {"post_norms"}) | {"pre_norms", "moe", "moe_pattern", "expert_width",
                                                  "shared_experts", "routed_scaling", "sigmoid_router"}


def from_hf(hf: HFConfig) -> dict:
    width = hf.get("moe_intermediate_size")
    return exaone4.from_hf(hf) | dict(
        norm_position="pre", mlp_layer_types=glm4_moe_lite.mlp_kinds(hf, hf.get("first_k_dense_replace")),
        num_local_experts=hf.get("num_experts"), num_experts_per_tok=hf.get("num_experts_per_tok"),
        moe_intermediate_size=width, shared_expert_intermediate_size=hf.get("num_shared_experts") * width,
        routed_scaling_factor=hf.get("routed_scaling_factor"), n_group=hf.get("n_group"),
        topk_group=hf.get("topk_group"), norm_topk_prob=hf.get("norm_topk_prob"), router_kind="sigmoid_groups",
        router_aux_loss_coef=0.0)


def to_hf(a) -> dict:
    """EXAONE 4's and the MoE's; no pad id unless the imported config.json had one (the architecture records none,
    and transformers' default, 0, is a token of the vocabulary)."""
    m = a.moe or NO_MOE
    kinds = glm4_moe_lite.mlp_kinds_to_hf(a)
    return exaone4.to_hf(a) | dict(
        mlp_layer_types=kinds, first_k_dense_replace=kinds.index("sparse") if "sparse" in kinds else len(kinds),
        num_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=a.expert_size, num_shared_experts=m.shared_expert_intermediate_size // a.expert_size,
        routed_scaling_factor=m.routed_scaling_factor, n_group=m.n_group, topk_group=m.topk_group,
        norm_topk_prob=m.norm_topk_prob, pad_token_id=None)


def layer_weights(a, spec):
    return renamed(glm4_moe.layer_weights(a, spec), (("mlp.gate.e_score_correction_bias",
                                                      "mlp.e_score_correction_bias"),))


EXAONE_MOE = Family(
    "exaone_moe", ("exaone_moe",), "ExaoneMoeForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"exaone-moe-tiny": exaone4.EXAONE4.presets["exaone4-tiny"] | dict(
        norm_position="pre", num_hidden_layers=3, layer_types=("sliding_attention", "sliding_attention",
                                                               "full_attention"),
        rope_layers=(True, True, False), num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        router_kind="sigmoid_groups", router_aux_loss_coef=0.0, mlp_layer_types=("dense", "moe", "moe"))})
