"""BitNet (b1.58): Llama's layout with BitNet's sub-norms (``sub_norms``: ``self_attn.attn_sub_norm``
before o_proj, ``mlp.ffn_sub_norm`` before down_proj), a gated relu2 MLP, one ``attention_bias`` flag
for q/k/v and o, rotary base 500000 by default.

A ``quantization_config`` of BitLinear's online quantization (``autobitlinear``, ``online``: the
bf16 master weights, quantized in the forward; transformers' AutoBitLinear) reads as ``bitlinear``:
ternary weights by their mean |w|, 8-bit inputs per token, the head unquantized. Weights packed
four to a byte (``bitlinear``, ``offline``: the deployment checkpoint) are refused, naming the
field. Without one transformers builds plain linear layers (from_config), and so does this.
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig, HFError, Weight

# BitNetConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=128256, hidden_size=2560, intermediate_size=6912, num_hidden_layers=30, num_attention_heads=20,
              num_key_value_heads=5, hidden_act="relu2", max_position_embeddings=2048, initializer_range=0.02,
              rms_norm_eps=1e-5, use_cache=True, pad_token_id=None, bos_token_id=128000, eos_token_id=128001,
              tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0, rope_parameters=None)
FEATURES = llama.ROTARY | {"attention_bias", "attention_out_bias", "sub_norms", "bitlinear"}
# the quantization_config of BitLinear's online quantization (transformers' BitNetQuantConfig)
ONLINE = {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"}


def _bitlinear(hf: HFConfig) -> bool:
    """Whether config.json asks for BitLinear's online quantization; an HFError for another."""
    q = hf.raw.get("quantization_config")
    if q is None:
        return False
    if ({k: q.get(k) for k in ONLINE} != ONLINE or q.get("use_rms_norm")
            or q.get("modules_to_not_convert") not in (None, ["lm_head"])):  # the head is never quantized
        raise HFError(f"{hf.where}: quantization_config={q!r}: shardzoo's bitnet reads BitLinear's online "
                      f"quantization only ({ONLINE}), not weights packed offline")
    return True


def from_hf(hf: HFConfig) -> dict:
    bias = hf.get("attention_bias")
    return llama.rotary_fields(hf, theta=500000.0) | dict(attention_bias=bias, attention_out_bias=bias, sub_norms=True,
                                                           bitlinear=_bitlinear(hf))


def to_hf(a) -> dict:
    quantized = {"quantization_config": dict(ONLINE)} if a.bitlinear else {}
    return llama.rotary_to_hf(a) | dict(attention_bias=a.attention_bias) | quantized


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    return llama.attention_weights(a) + llama.mlp_weights(a) + [
        Weight(("attn", "sub_norm", "scale"), h + "self_attn.attn_sub_norm.weight", "vec"),
        Weight(("mlp", "sub_norm", "scale"), h + "mlp.ffn_sub_norm.weight")]


BITNET = Family("bitnet", ("bitnet",), "BitNetForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, llama.global_weights,
                layer_weights)
