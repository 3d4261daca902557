"""Sarvam-MLA: DeepSeek-V3 (models/hf/deepseek_v3.py; transformers builds ``DeepseekV3ForCausalLM``
for it) under its own ``model_type`` and defaults. Its older configs' ``head_dim`` and
``q_head_dim`` (derived sizes) are ignored as transformers ignores them, and their
``rope_scaling`` type "deepseek_yarn" read as "yarn", as transformers converts it.
"""

from __future__ import annotations

from shardzoo.models.hf import deepseek_v2, deepseek_v3, llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig

# SarvamMLAConfig's fields and defaults (transformers 5.25; num_mtp_layers as config.json spells it),
# and the older configs' head_dim and q_head_dim
SCHEMA = {k: v for k, v in deepseek_v3.SCHEMA.items() if k != "num_nextn_predict_layers"} | dict(
    vocab_size=262144, hidden_size=4096, intermediate_size=16384, num_hidden_layers=32, num_attention_heads=64,
    num_key_value_heads=None, n_routed_experts=128, q_lora_rank=None, n_group=1, topk_group=1,
    first_k_dense_replace=1, initializer_range=0.006, num_mtp_layers=0, head_dim=None, q_head_dim=None)


def from_hf(hf: HFConfig) -> dict:
    scaling = hf.raw.get("rope_scaling") or {}
    if "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type")):
        hf.raw["rope_scaling"] = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": "yarn"}
    hf.ignore("num_mtp_layers", "q_head_dim")  # the causal LM builds no MTP module; a derived size
    return deepseek_v2.latent_fields(hf) | deepseek_v2.moe_fields(hf) | dict(
        rope_interleaved=bool(hf.get("rope_interleave")), router_kind="sigmoid_groups",
        norm_topk_prob=hf.get("norm_topk_prob"), router_aux_loss_coef=0.0)


SARVAM_MLA = Family(
    "sarvam_mla", ("sarvam_mla",), "DeepseekV3ForCausalLM", SCHEMA, deepseek_v3.FEATURES, from_hf,
    deepseek_v3.to_hf, llama.global_weights, deepseek_v2.layer_weights, execution=mixtral.HF_MOE,
    presets={"sarvam-mla-tiny": deepseek_v3.TINY})
