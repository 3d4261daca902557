"""Param-2 MoE: Sarvam-MoE's model (models/hf/sarvam_moe.py: GLM-4.5's MoE with full rotary by
default, under Sarvam's tensor and config names; transformers builds ``Glm4MoeForCausalLM``
for both) with its own ``model_type`` and defaults (rotary base 5e5, tied embeddings).
"""

from __future__ import annotations

from shardzoo.models.hf import glm4_moe, mixtral, sarvam_moe
from shardzoo.models.hf.base import Family, HFConfig

# Param2MoeConfig's fields and defaults (transformers 5.25)
SCHEMA = sarvam_moe.SCHEMA | dict(
    vocab_size=128000, hidden_size=2048, intermediate_size=9216, num_hidden_layers=21, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=32768, initializer_range=0.02,
    tie_word_embeddings=True, moe_intermediate_size=2048, n_shared_experts=2, n_routed_experts=64,
    eos_token_id=3)


def from_hf(hf: HFConfig) -> dict:
    return sarvam_moe.from_hf(hf, theta=5e5)


PARAM2MOE = Family(
    "param2moe", ("param2moe",), "Glm4MoeForCausalLM", SCHEMA, glm4_moe.FEATURES, from_hf, glm4_moe.to_hf,
    sarvam_moe.global_weights, sarvam_moe.layer_weights, execution=mixtral.HF_MOE,
    presets={"param2moe-tiny": sarvam_moe.SARVAM_MOE.presets["sarvam-moe-tiny"] | dict(rope_theta=5e5)})
