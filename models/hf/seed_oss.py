"""Seed-OSS: Llama's layout with its biases on three flags: ``attention_bias`` (q/k/v, on by
default), ``attention_out_bias`` (o) and ``mlp_bias``; ``head_dim`` 128 by default whatever the
width. ``residual_dropout`` is a dropout rate, which shardzoo does not apply (as the others).
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig

# SeedOssConfig's fields and defaults (transformers 5)
SCHEMA = llama.SCHEMA | dict(
    vocab_size=155136, hidden_size=4096, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=80,
    num_key_value_heads=8, max_position_embeddings=524288, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    attention_bias=True, attention_out_bias=False, attention_dropout=0.1, residual_dropout=0.1, head_dim=128)
FEATURES = llama.ROTARY | {"attention_bias", "attention_out_bias", "mlp_bias"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore("residual_dropout")
    return llama.rotary_fields(hf) | dict(
        head_dim=hf.get("head_dim"),  # 128 when missing (the schema's), hidden_size // heads when null
        attention_bias=hf.get("attention_bias"), attention_out_bias=hf.get("attention_out_bias"),
        mlp_bias=hf.get("mlp_bias"))


def to_hf(a) -> dict:
    return llama.rotary_to_hf(a) | dict(attention_bias=a.attention_bias, attention_out_bias=a.attention_out_bias,
                                        mlp_bias=a.mlp_bias)


SEED_OSS = Family(
    "seed_oss", ("seed_oss",), "SeedOssForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, llama.layer_weights,
    presets={"seed-oss-tiny": llama.TINY | dict(attention_bias=True, mlp_bias=True)})
