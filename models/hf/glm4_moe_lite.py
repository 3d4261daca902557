"""GLM-4.7-Flash (``glm4_moe_lite``): DeepSeek-V3's model (models/hf/deepseek_v3.py: latent
attention, the sigmoid router with its correction bias and groups, shared experts) whose dense
and MoE layers are listed in ``mlp_layer_types`` ("dense" | "sparse"; by default the first
dense) instead of ``first_k_dense_replace``.
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, MOE
from shardzoo.models.hf import deepseek_v2, deepseek_v3, llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig

# Glm4MoeLiteConfig's fields and defaults (transformers 5.25)
# (and first_k_dense_replace, which the published config.json still carries: mlp_layer_types decides)
SCHEMA = (deepseek_v3.SCHEMA
          | dict(vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
                 num_hidden_layers=47, num_attention_heads=20, num_key_value_heads=20, n_routed_experts=64,
                 routed_scaling_factor=1.8, q_lora_rank=768, v_head_dim=256, qk_nope_head_dim=192, n_group=1,
                 topk_group=1, num_experts_per_tok=4, max_position_embeddings=202752, rms_norm_eps=1e-5,
                 mlp_layer_types=None))
_KINDS = {"dense": DENSE, "sparse": MOE}


def mlp_kinds(hf: HFConfig, first_dense: int = 1) -> tuple[str, ...]:
    """``mlp_layer_types`` ("dense" | "sparse") as layer kinds; by default the first ``first_dense``
    layers dense, the rest MoE (EXAONE-MoE reads them alike)."""
    n, kinds = hf.get("num_hidden_layers"), hf.get("mlp_layer_types")
    if kinds is None:
        kinds = ["dense" if i < first_dense else "sparse" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or any(k not in _KINDS for k in kinds):
        raise hf.refuse("mlp_layer_types", f"must list 'dense' or 'sparse' for each of the {n} layers")
    return tuple(_KINDS[k] for k in kinds)


def mlp_kinds_to_hf(a) -> list[str]:
    return ["sparse" if s.mlp == MOE else "dense" for s in a.layer_specs()]


def from_hf(hf: HFConfig) -> dict:
    return deepseek_v3.from_hf(hf) | dict(mlp_layer_types=mlp_kinds(hf))


def to_hf(a) -> dict:
    out = deepseek_v3.to_hf(a)
    del out["first_k_dense_replace"]
    return out | dict(mlp_layer_types=mlp_kinds_to_hf(a))


GLM4_MOE_LITE = Family(
    "glm4_moe_lite", ("glm4_moe_lite",), "Glm4MoeLiteForCausalLM", SCHEMA, deepseek_v3.FEATURES, from_hf, to_hf,
    llama.global_weights, deepseek_v2.layer_weights, execution=mixtral.HF_MOE,
    presets={"glm4-moe-lite-tiny": deepseek_v3.TINY | dict(mlp_layer_types=(DENSE, MOE, DENSE))})
