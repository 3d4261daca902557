"""HyperCLOVA X (Naver): Granite's layer and multipliers (models/hf/granite.py) with norms after
attention and MLP too when ``use_post_norm`` (``post_norm1``, ``post_norm2``: Gemma 2's sandwich
norms, the residual multiplier after them), the attention scale ``attention_multiplier`` (null:
1/sqrt(head_dim)), and logits MULTIPLIED by ``logits_scaling`` (Cohere's ``logit_scale``; Granite
divides by it).
"""

from __future__ import annotations

import dataclasses

from shardzoo.models.hf import granite, llama
from shardzoo.models.hf.base import Family, HFConfig, Weight

# HyperCLOVAXConfig's fields and defaults (transformers 5.25)
SCHEMA = granite.SCHEMA | dict(head_dim=None, attention_multiplier=None, use_post_norm=True)
FEATURES = llama.LLAMA_FEATURES | {"multipliers", "sandwich_norms", "logit_scale"}


def from_hf(hf: HFConfig) -> dict:
    out = granite.from_hf(hf)
    return out | dict(logits_scaling=1.0, logit_scale=out["logits_scaling"],
                      norm_position="both" if hf.get("use_post_norm") else "pre")


def to_hf(a) -> dict:
    return granite.to_hf(a) | dict(logits_scaling=a.logit_scale, use_post_norm=a.norm_position == "both")


def layer_weights(a, spec) -> list[Weight]:
    """Llama's pre-norm layer, and the norms after attention and MLP."""
    both = a.norm_position == "both"
    out = llama.layer_weights(dataclasses.replace(a, norm_position="pre") if both else a, spec)
    if both:
        out += [Weight(("post_attn_norm", "scale"), llama.LAYER + "post_norm1.weight"),
                Weight(("post_mlp_norm", "scale"), llama.LAYER + "post_norm2.weight")]
    return out


HYPERCLOVAX = Family(
    "hyperclovax", ("hyperclovax",), "HyperCLOVAXForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights,
    presets={"hyperclovax-tiny": granite.TINY | dict(norm_position="both", logits_scaling=1.0, logit_scale=0.5)})
