"""CWM (Meta's Code World Model): Llama without biases, with sliding and full layers by
``layer_types`` (by default every 4th layer, from the first, full), rotary base 1e6 and, when
config.json names no rotary settings at all, transformers' llama3 scaling (factor 16 from 8192).
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.hf import llama
from shardzoo.models.hf.base import ROPE_KEYS, Family, HFConfig, layer_types

# CwmConfig's fields and defaults (transformers 5.25)
SCHEMA = {k: v for k, v in llama.SCHEMA.items() if k != "attention_bias"} | dict(
    vocab_size=128256, hidden_size=6144, intermediate_size=21504, num_hidden_layers=64, num_attention_heads=48,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, eos_token_id=None,
    bos_token_id=128000, sliding_window=8192, layer_types=None)
FEATURES = llama.ROTARY | {"sliding_window", "layer_pattern", "mlp_bias"}
_ROPE = dict(rope_theta=1e6, factor=16.0, high_freq_factor=4.0, low_freq_factor=1.0,
             original_max_position_embeddings=8192, rope_type="llama3")


def from_hf(hf: HFConfig) -> dict:
    if not any(k in hf.raw for k in ROPE_KEYS):
        hf.raw["rope_parameters"] = dict(_ROPE)
    n, window = hf.get("num_hidden_layers"), hf.get("sliding_window")
    types = hf.get("layer_types") or [FULL if i % 4 == 0 else SLIDING for i in range(n)]
    out = llama.rotary_fields(hf, theta=1e6) | dict(mlp_bias=hf.get("mlp_bias"))
    if out["eos_token_id"] is None:  # transformers' default
        out["eos_token_id"] = (128001, 128008, 128009)
    if not window or SLIDING not in types:
        return out | dict(sliding_window=None, layer_types=None)
    return out | dict(sliding_window=window, layer_types=tuple(types))


def to_hf(a) -> dict:
    return llama.rotary_to_hf(a) | dict(mlp_bias=a.mlp_bias, sliding_window=a.sliding_window,
                                        layer_types=layer_types(a))


CWM = Family(
    "cwm", ("cwm",), "CwmForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, llama.global_weights, llama.layer_weights,
    presets={"cwm-tiny": llama.TINY | dict(num_hidden_layers=4, sliding_window=8, rope_theta=1e6,
                                           layer_types=(FULL, SLIDING, SLIDING, SLIDING))})
