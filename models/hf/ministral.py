"""Ministral: Mistral's tensors and config.json with a ``layer_types`` list, so sliding-window
and full-attention layers mix in any pattern (transformers' default: every layer sliding when
``sliding_window`` is set, else every layer full)."""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig, layer_types

SCHEMA = llama.MISTRAL.schema | dict(max_position_embeddings=131072, layer_types=None)
FEATURES = llama.MISTRAL.features | {"layer_pattern"}


def from_hf(hf: HFConfig) -> dict:
    return llama.rotary_fields(hf) | llama.window_fields(hf, hf.get("sliding_window"))


def to_hf(a) -> dict:
    return llama.rotary_to_hf(a) | dict(sliding_window=a.sliding_window, layer_types=layer_types(a))


MINISTRAL = Family(
    "ministral", ("ministral",), "MinistralForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, llama.layer_weights,
    presets={
        # a window shorter than a test's text, on three layers of four
        "ministral-tiny": llama.TINY | dict(num_hidden_layers=4, sliding_window=8,
                                            layer_types=("sliding_attention",) * 3 + ("full_attention",)),
    })
