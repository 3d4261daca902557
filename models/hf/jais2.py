"""Jais 2 (G42/Inception): Llama's layout with LayerNorms with bias (StableLM's tensors,
models/hf/stablelm.py), biases on q/k/v and o by ``attention_bias``, and Nemotron's plain MLP
(up, relu2, down) with biases by ``mlp_bias``."""

from __future__ import annotations

from shardzoo.models.hf import llama, stablelm
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, rope, sizes

# Jais2Config's fields and defaults (transformers 5.25)
SCHEMA = {k: v for k, v in llama.SCHEMA.items() if k not in ("rms_norm_eps", "pretraining_tp")} | dict(
    vocab_size=150272, hidden_size=3328, intermediate_size=26624, num_attention_heads=26, hidden_act="relu2",
    max_position_embeddings=8192, layer_norm_eps=1e-5, bos_token_id=0, eos_token_id=150024, attention_bias=True,
    mlp_bias=True)
FEATURES = (llama.LLAMA_FEATURES - {"rmsnorm", "gated_mlp"}) | {"layernorm", "plain_mlp"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    out = sizes(hf, "layer_norm_eps") | rope(hf)
    out.pop("partial_rotary_factor")  # Jais 2 rotates whole heads
    bias = hf.get("attention_bias")
    return out | dict(norm_type="layernorm", mlp_type="plain", attention_bias=bias, attention_out_bias=bias,
                      mlp_bias=hf.get("mlp_bias"))


def to_hf(a) -> dict:
    out = llama.rotary_to_hf(a) | dict(layer_norm_eps=a.rms_norm_eps, attention_bias=a.attention_bias,
                                       mlp_bias=a.mlp_bias)
    del out["rms_norm_eps"]
    return out


def layer_weights(a, spec) -> list[Weight]:
    """StableLM's (LayerNorms with bias, q/k/v biases), the o bias, and the plain MLP's."""
    out = stablelm.layer_weights(a, spec)
    if a.attention_out_bias:
        out.append(Weight(("attn", "o", "bias"), llama.LAYER + "self_attn.o_proj.bias", "vec"))
    return out


JAIS2 = Family(
    "jais2", ("jais2",), "Jais2ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, stablelm.global_weights, layer_weights,
    presets={"jais2-tiny": llama.TINY | dict(norm_type="layernorm", rms_norm_eps=1e-5, mlp_type="plain",
                                             hidden_act="relu2", attention_bias=True, attention_out_bias=True,
                                             mlp_bias=True)})
