"""OLMo 1 (AllenAI; ``olmo``): Llama's layout with LayerNorms that have neither weight nor bias
(norm kind ``layernorm_no_weight``, epsilon 1e-5 fixed), one ``attention_bias`` flag for q/k/v
and o, and q, k and v clipped to ``[-clip_qkv, clip_qkv]`` after their projections.
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    rope,
    rope_to_hf,
    sizes,
    sizes_to_hf,
)

EPS = 1e-5  # OlmoLayerNorm's, fixed
# OlmoConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
              initializer_range=0.02, use_cache=True, pad_token_id=1, bos_token_id=None, eos_token_id=50279,
              tie_word_embeddings=False, rope_parameters=None, attention_bias=False, attention_dropout=0.0,
              clip_qkv=None)
FEATURES = (llama.ROTARY - {"rmsnorm"}) | {"layernorm_no_weight", "attention_bias", "attention_out_bias", "clip_qkv"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    bias = hf.get("attention_bias")
    out = sizes(hf, EPS) | rope(hf)
    del out["partial_rotary_factor"]
    return out | dict(norm_type="layernorm_no_weight", attention_bias=bias, attention_out_bias=bias,
                      clip_qkv=hf.get("clip_qkv"))


def to_hf(a) -> dict:
    out = sizes_to_hf(a) | rope_to_hf(a) | dict(attention_bias=a.attention_bias, clip_qkv=a.clip_qkv)
    del out["rms_norm_eps"]
    return out


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), "model.embed_tokens.weight")]  # the final norm has no weight
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "lm_head.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    return [w for w in llama.attention_weights(a) if w.path[0] == "attn"] + llama.mlp_weights(a)


BASE = dict(norm_type="layernorm_no_weight", rms_norm_eps=EPS)
OLMO = Family(
    "olmo", ("olmo",), "OlmoForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        # allenai/OLMo-1B-hf/config.json
        "olmo-1b": BASE | dict(vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=16, max_position_embeddings=2048, tie_word_embeddings=True,
                               bos_token_id=None, eos_token_id=50279),
        "olmo-tiny": BASE | llama.TINY | dict(clip_qkv=8.0),
    })
