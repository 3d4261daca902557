"""Nemotron (NVIDIA Nemotron-4, Minitron): Llama's layout with LayerNorm1P (a LayerNorm with bias
scaling by 1 + weight: norm kind ``layernorm_plus_one``), a plain squared-ReLU MLP (``up_proj``,
``relu2``, ``down_proj``), rotary embeddings on the first ``partial_rotary_factor`` of each head
(0.5 when config.json names none) and one ``attention_bias`` flag for q/k/v and o.
"""

from __future__ import annotations

from shardzoo.models.hf import llama, phi
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

# NemotronConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=256000, hidden_size=6144, intermediate_size=24576, num_hidden_layers=32,
              num_attention_heads=48, head_dim=None, num_key_value_heads=None, hidden_act="relu2",
              max_position_embeddings=4096, initializer_range=0.0134, norm_eps=1e-5, use_cache=True,
              pad_token_id=None, bos_token_id=2, eos_token_id=3, tie_word_embeddings=False, rope_parameters=None,
              attention_bias=False, attention_dropout=0.0, mlp_bias=False)
FEATURES = (llama.ROTARY - {"rmsnorm", "gated_mlp"}) | {"layernorm_plus_one", "plain_mlp", "partial_rotary",
                                                        "attention_bias", "attention_out_bias", "mlp_bias"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    bias = hf.get("attention_bias")  # one flag for q/k/v and o
    return sizes(hf, "norm_eps") | rope(hf, rotary=0.5) | dict(
        norm_type="layernorm_plus_one", mlp_type="plain", attention_bias=bias, attention_out_bias=bias,
        mlp_bias=hf.get("mlp_bias"))


def to_hf(a) -> dict:
    out = sizes_to_hf(a) | rope_to_hf(a) | dict(norm_eps=a.rms_norm_eps, partial_rotary_factor=a.partial_rotary_factor,
                                                 attention_bias=a.attention_bias, mlp_bias=a.mlp_bias)
    del out["rms_norm_eps"]
    return out


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), "model.embed_tokens.weight")] + phi._both(("final_norm",), "model.norm")
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "lm_head.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    norms = phi._both(("attn_norm",), h + "input_layernorm") + phi._both(("mlp_norm",), h + "post_attention_layernorm")
    return norms + [w for w in llama.attention_weights(a) if w.path[0] == "attn"] + llama.mlp_weights(a)


BASE = dict(norm_type="layernorm_plus_one", mlp_type="plain", hidden_act="relu2", rms_norm_eps=1e-5,
            partial_rotary_factor=0.5, initializer_range=0.0134, bos_token_id=2, eos_token_id=3)
NEMOTRON = Family(
    "nemotron", ("nemotron",), "NemotronForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights,
    layer_weights,
    presets={
        # nvidia/Minitron-4B-Base (Nemotron-4 4B)/config.json
        "minitron-4b": BASE | dict(vocab_size=256000, hidden_size=3072, intermediate_size=9216, num_hidden_layers=32,
                                   num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=4096),
        "nemotron-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     bos_token_id=None, eos_token_id=None),
    })
