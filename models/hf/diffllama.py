"""DiffLlama: Llama's layout with differential attention (``diff_attention``: models/differential.py):
each layer's ``self_attn.lambda_q1``, ``lambda_k1``, ``lambda_q2``, ``lambda_k2`` beside Llama's
projections (one ``attention_bias`` flag for q/k/v and o), the head-pair norm without weight, and
lambda_init from the layer's index. ``lambda_std_dev`` only draws the initial lambdas.
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig, Weight

SCHEMA = dict(llama.SCHEMA, rms_norm_eps=1e-5, intermediate_size=8192, hidden_size=2048, num_hidden_layers=16,
              lambda_std_dev=0.1)
SCHEMA.pop("pretraining_tp")
SCHEMA.pop("mlp_bias")
FEATURES = llama.ROTARY | {"attention_bias", "attention_out_bias", "differential_attention"}
LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def from_hf(hf: HFConfig) -> dict:
    hf.ignore("lambda_std_dev")  # the initial lambdas' spread
    bias = hf.get("attention_bias")
    return llama.rotary_fields(hf) | dict(attention_bias=bias, attention_out_bias=bias, diff_attention=True)


def to_hf(a) -> dict:
    return llama.rotary_to_hf(a) | dict(attention_bias=a.attention_bias)


def layer_weights(a, spec) -> list[Weight]:
    lambdas = [Weight(("attn", n), llama.LAYER + f"self_attn.{n}", "vec") for n in LAMBDAS]
    return llama.attention_weights(a) + lambdas + llama.mlp_weights(a)


DIFFLLAMA = Family(
    "diffllama", ("diffllama",), "DiffLlamaForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, llama.global_weights,
    layer_weights)
