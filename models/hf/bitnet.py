"""BitNet (b1.58): Llama's layout with BitNet's sub-norms (``sub_norms``: ``self_attn.attn_sub_norm``
before o_proj, ``mlp.ffn_sub_norm`` before down_proj), a gated relu2 MLP, one ``attention_bias`` flag
for q/k/v and o, rotary base 500000 by default.

Its published checkpoints compute through BitLinear (``quantization_config``: ternary weights,
8-bit activations, or weights packed four to a byte), which shardzoo does not implement: a
config.json with a ``quantization_config`` is refused, naming it. transformers builds the model of
a config.json without one (from_config) with plain linear layers: that model is what this reads.
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig, HFError, Weight

# BitNetConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=128256, hidden_size=2560, intermediate_size=6912, num_hidden_layers=30, num_attention_heads=20,
              num_key_value_heads=5, hidden_act="relu2", max_position_embeddings=2048, initializer_range=0.02,
              rms_norm_eps=1e-5, use_cache=True, pad_token_id=None, bos_token_id=128000, eos_token_id=128001,
              tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0, rope_parameters=None)
FEATURES = llama.ROTARY | {"attention_bias", "attention_out_bias", "sub_norms"}


def from_hf(hf: HFConfig) -> dict:
    if "quantization_config" in hf:
        raise HFError(f"{hf.where}: quantization_config (BitLinear's ternary weights and 8-bit activations) is not "
                      "implemented by shardzoo's bitnet; it reads the unquantized model only")
    bias = hf.get("attention_bias")
    return llama.rotary_fields(hf, theta=500000.0) | dict(attention_bias=bias, attention_out_bias=bias, sub_norms=True)


def to_hf(a) -> dict:
    return llama.rotary_to_hf(a) | dict(attention_bias=a.attention_bias)


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    return llama.attention_weights(a) + llama.mlp_weights(a) + [
        Weight(("attn", "sub_norm", "scale"), h + "self_attn.attn_sub_norm.weight", "vec"),
        Weight(("mlp", "sub_norm", "scale"), h + "mlp.ffn_sub_norm.weight")]


BITNET = Family("bitnet", ("bitnet",), "BitNetForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, llama.global_weights,
                layer_weights)
