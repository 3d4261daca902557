"""Granite-SWA: Granite (models/hf/granite.py: its four multipliers) with sliding-window layers
(``layer_types``; by default every fourth layer full from the first, the others sliding),
GPT-OSS's attention sinks (``self_attn.sinks``: transformers scales the output by
sigmoid(logsumexp - sink), which is a sink logit in the softmax's denominator) and a rotary base
per layer (``layer_rope_theta``; 0: NoPE). Bases that differ between rotary layers are refused
in one line; one base with NoPE layers among them reads as SmolLM3's ``rope_layers``.
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.hf import granite, llama
from shardzoo.models.hf.base import Family, HFConfig, Weight, layer_types

# GraniteSWAConfig's fields and defaults (transformers 5.25)
SCHEMA = granite.SCHEMA | dict(
    vocab_size=100352, hidden_size=2560, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=20,
    num_key_value_heads=4, max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=100257,
    eos_token_id=100257, tie_word_embeddings=True, sliding_window=128, layer_types=None, layer_rope_theta=None)
FEATURES = granite.GRANITE.features | {"sliding_window", "layer_pattern", "attention_sinks", "nope_layers"}


def swa_fields(hf: HFConfig, fields: dict) -> dict:
    """``fields`` (the Granite model's) with the sliding layers, sinks and per-layer rotary bases
    (Granite-MoE-SWA reads them alike)."""
    n = hf.get("num_hidden_layers")
    types = hf.get("layer_types") or [FULL if i % 4 == 0 else SLIDING for i in range(n)]
    window = hf.get("sliding_window")
    thetas = hf.get("layer_rope_theta")
    if thetas is not None:
        if not isinstance(thetas, list) or len(thetas) < n:
            raise hf.refuse("layer_rope_theta", f"must give each of the {n} layers a rotary base (0: NoPE)")
        bases = {float(t) for t in thetas[:n] if t}
        if len(bases) > 1:
            raise hf.refuse("layer_rope_theta", "rotary bases that differ between layers are not implemented "
                                                "(one base, or 0 for NoPE)")
        fields |= dict(rope_theta=bases.pop() if bases else fields["rope_theta"],
                       rope_layers=tuple(bool(t) for t in thetas[:n]))
    if window is None or SLIDING not in types:
        return fields | dict(sliding_window=None, layer_types=None, attention_sinks=True)
    return fields | dict(sliding_window=window, layer_types=tuple(types), attention_sinks=True)


def from_hf(hf: HFConfig) -> dict:
    return swa_fields(hf, granite.from_hf(hf))


def swa_to_hf(a) -> dict:
    return dict(sliding_window=a.sliding_window, layer_types=layer_types(a),
                layer_rope_theta=[a.rope_theta if s.rope != "none" else 0 for s in a.layer_specs()])


def to_hf(a) -> dict:
    return granite.to_hf(a) | swa_to_hf(a)


SINKS = Weight(("attn", "sinks"), llama.LAYER + "self_attn.sinks")


def layer_weights(a, spec) -> list[Weight]:
    return llama.layer_weights(a, spec) + [SINKS]


GRANITE_SWA = Family(
    "granite_swa", ("granite_swa",), "GraniteSWAForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights,
    presets={"granite-swa-tiny": granite.TINY | dict(num_hidden_layers=4, sliding_window=8, attention_sinks=True,
                                                     layer_types=(FULL, SLIDING, SLIDING, SLIDING))})
