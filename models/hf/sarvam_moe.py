"""Sarvam-MoE (transformers computes it with Glm4MoeForCausalLM): GLM-4.5's model
(models/hf/glm4_moe.py: qk-norm of each head, DeepSeek-V3's MoE after ``first_k_dense_replace``
dense layers) with full rotary embeddings (base 8e6) by default, under its own tensor names
(``word_embeddings``, ``attention.query_key_value`` holding q | k | v rows, unequal under GQA,
``attention.dense``, ``query_layernorm``/``key_layernorm``, the router's ``expert_bias``) and
config names (``num_experts``, ``num_shared_experts``, ``use_qkv_bias``: aliases, read either way).
"""

from __future__ import annotations

import dataclasses

from shardzoo.models.hf import glm4_moe, llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig, Weight, renamed, rope

# SarvamMoEConfig's fields and defaults (transformers 5.25: Glm4MoeConfig's but these)
SCHEMA = ({k: v for k, v in glm4_moe.SCHEMA.items() if k != "num_nextn_predict_layers"}
          | dict(vocab_size=262144, intermediate_size=8192, num_hidden_layers=19, num_attention_heads=64,
                 num_key_value_heads=4, head_dim=64, initializer_range=0.006, rms_norm_eps=1e-6,
                 moe_intermediate_size=1024, num_experts_per_tok=6, routed_scaling_factor=2.5, use_qk_norm=True,
                 num_mtp_layers=0, pad_token_id=0, eos_token_id=1))
ALIASES = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts",
           "use_qkv_bias": "attention_bias", "num_nextn_predict_layers": "num_mtp_layers"}
# GLM-4.5's tensor names -> Sarvam's (q, k and v fused below)
_NAMES = (("model.embed_tokens.", "model.word_embeddings."), (".self_attn.o_proj.", ".attention.dense."),
          (".self_attn.q_norm.", ".attention.query_layernorm."), (".self_attn.k_norm.", ".attention.key_layernorm."),
          (".mlp.gate.e_score_correction_bias", ".mlp.gate.expert_bias"))


def from_hf(hf: HFConfig, theta: float = 8e6) -> dict:
    """(``theta``: the family's default rotary base; Param-2 MoE's 5e5.)"""
    hf.unalias(ALIASES)  # the published config.json's names
    hf.ignore("num_mtp_layers")  # transformers builds no multi-token-prediction layer for the causal LM
    return glm4_moe.from_hf(hf) | rope(hf, theta=theta)  # full rotary unless config.json says otherwise


def _renamed(ws: list[Weight]) -> list[Weight]:
    return renamed(ws, _NAMES)


def global_weights(a) -> list[Weight]:
    return _renamed(llama.global_weights(a))


def layer_weights(a, spec) -> list[Weight]:
    """GLM-4.5's layer under Sarvam's names, q, k and v (and their biases) column blocks of one tensor."""
    heads, qkv = (a.num_attention_heads, a.kv_heads, a.kv_heads), llama.LAYER + "attention.query_key_value."
    out = []
    for w in _renamed(glm4_moe.layer_weights(a, spec)):
        if w.path[0] == "attn" and w.path[1] in "qkv" and ".self_attn." in w.name:
            j, op = "qkv".index(w.path[1]), w.op
            w = dataclasses.replace(w, name=qkv + w.name.rsplit(".", 1)[1], part=(j, 3), widths=heads, op=op)
        out.append(w)
    return out


SARVAM_MOE = Family(
    "sarvam_moe", ("sarvam_moe",), "Glm4MoeForCausalLM", SCHEMA, glm4_moe.FEATURES, from_hf, glm4_moe.to_hf,
    global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"sarvam-moe-tiny": glm4_moe.TINY | dict(partial_rotary_factor=1.0, rope_theta=8e6)})
