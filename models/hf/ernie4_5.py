"""Ernie 4.5 (Baidu; the dense ``ernie4_5``): Llama's layout with rotary embeddings turning
interleaved pairs of features (2i, 2i+1) in float32 (``rope_interleaved``, as Cohere), one flag
``use_bias`` for every projection's bias (q/k/v, o, and the MLP's gate, up and down; not the
output head), tied embeddings by default.

transformers quirks: ``head_dim`` defaults to 128 (not hidden_size / heads) when config.json
lacks it, and ``num_key_value_heads`` to 2; an explicit null means hidden_size / heads and
as many kv heads as heads. The rotary base defaults to 500000.
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import INERT, Family, HFConfig, rope, sizes

# Ernie4_5Config's fields and defaults (transformers 5)
SCHEMA = dict(vocab_size=103424, hidden_size=1024, intermediate_size=3072, num_hidden_layers=18,
              num_attention_heads=16, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=131072,
              initializer_range=0.02, rms_norm_eps=1e-5, use_cache=True, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=True, rope_parameters=None, use_bias=False, head_dim=128)
THETA = 500000.0
FEATURES = llama.ROTARY | {"rope_interleaved", "attention_bias", "attention_out_bias", "mlp_bias"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    out = sizes(hf) | rope(hf, theta=THETA)
    out.pop("partial_rotary_factor")  # whole heads rotate
    out.update(num_key_value_heads=hf.get("num_key_value_heads") or out["num_attention_heads"],
               head_dim=hf.get("head_dim"))  # absent: 128; null: hidden_size / heads
    bias = hf.get("use_bias")
    return out | dict(rope_interleaved=True, attention_bias=bias, attention_out_bias=bias, mlp_bias=bias)


def to_hf(a) -> dict:
    return llama.rotary_to_hf(a) | dict(use_bias=a.attention_bias)


BASE = dict(rope_interleaved=True, rms_norm_eps=1e-5, rope_theta=THETA, tie_word_embeddings=True)
# baidu/ERNIE-4.5-0.3B-PT/config.json (Ernie4_5Config's defaults)
ERNIE_03B = BASE | dict(vocab_size=103424, hidden_size=1024, intermediate_size=3072, num_hidden_layers=18,
                        num_attention_heads=16, num_key_value_heads=2, head_dim=128, max_position_embeddings=131072,
                        bos_token_id=1, eos_token_id=2)
ERNIE4_5 = Family(
    "ernie4_5", ("ernie4_5",), "Ernie4_5ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, llama.layer_weights,
    presets={"ernie-4.5-0.3b": ERNIE_03B,
             "ernie4.5-tiny": BASE | llama.TINY | dict(attention_bias=True, attention_out_bias=True, mlp_bias=True)})
