"""HunYuan dense (``hunyuan_v1_dense``): Llama's layout with an RMSNorm of each query and key
head applied after the rotary embedding (``self_attn.query_layernorm``, ``key_layernorm``;
Qwen3 norms before it). One flag, ``attention_bias``, for q/k/v/o biases.

The published models' rotary scaling, labelled ``dynamic`` with a fixed ``alpha`` (transformers
turns it into its static "ntk_alpha"), only stretches the base: theta * alpha ** (d / (d - 2)).
It imports as plain rotary with that base, which is the same math (and exports so).
"""

from __future__ import annotations

import dataclasses

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig

# HunYuanDenseV1Config's fields and defaults (transformers 5)
SCHEMA = ({k: v for k, v in llama.SCHEMA.items() if k != "mlp_bias"}
          | dict(vocab_size=290943, rms_norm_eps=1e-5, pad_token_id=0, eod_token_id=3))
FEATURES = llama.ROTARY | {"qk_norm_head", "qk_norm_after_rope", "attention_bias", "attention_out_bias"}
_NAMES = {"self_attn.q_norm.weight": "self_attn.query_layernorm.weight",
          "self_attn.k_norm.weight": "self_attn.key_layernorm.weight"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore("eod_token_id")  # a special token id, not the model's math
    bias = hf.get("attention_bias")  # one flag for q/k/v/o
    fields = llama.rotary_fields(hf)
    scaling = dict(fields["rope_scaling"] or {})
    if scaling.get("rope_type") == "dynamic" and scaling.get("alpha"):  # NTK by a fixed alpha
        dim = fields["head_dim"] or fields["hidden_size"] // fields["num_attention_heads"]
        fields |= dict(rope_theta=fields["rope_theta"] * scaling["alpha"] ** (dim / (dim - 2)), rope_scaling=None)
    return fields | dict(qk_norm="head", qk_norm_after_rope=True, attention_bias=bias, attention_out_bias=bias)


def to_hf(a) -> dict:
    return llama.rotary_to_hf(a) | dict(attention_bias=a.attention_bias)  # head_dim always (None breaks HF)


def layer_weights(a, spec):
    """Llama's layer with HunYuan's names of the q and k norms."""
    out = []
    for w in llama.layer_weights(a, spec):
        suffix = w.name.removeprefix(llama.LAYER)
        out.append(dataclasses.replace(w, name=llama.LAYER + _NAMES[suffix]) if suffix in _NAMES else w)
    return out


HUNYUAN_DENSE = Family(
    "hunyuan_v1_dense", ("hunyuan_v1_dense",), "HunYuanDenseV1ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights,
    presets={"hunyuan-dense-tiny": llama.TINY | dict(qk_norm="head", qk_norm_after_rope=True, rms_norm_eps=1e-5)})
