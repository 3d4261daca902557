"""Apertus (Swiss AI): Llama's attention with a norm of each query and key head before the
rotary embedding (``qk_norm`` "head"), a plain MLP (``up_proj``, ``down_proj``, no gate)
through xIELU (``hidden_act="xielu"``: four scalars per layer, ``mlp.act_fn.alpha_p``,
``alpha_n``, ``beta``, ``eps``; models/layers.py ``XIELU``), its norms named
``attention_layernorm`` and ``feedforward_layernorm``, and llama3 rope scaling by default.

transformers quirk: a config.json without ``rope_parameters`` and ``rope_scaling`` gets
ApertusConfig's llama3 rotary (``DEFAULT_ROPE``), whatever its ``rope_theta`` says; so export
always writes ``rope_parameters``.
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    rope,
    rope_parameters_to_hf,
    sizes,
    sizes_to_hf,
)

# ApertusConfig's fields and defaults (transformers 5)
SCHEMA = dict(vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=None, hidden_act="xielu", max_position_embeddings=65536,
              initializer_range=0.02, rms_norm_eps=1e-5, use_cache=True, pad_token_id=3, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, rope_parameters=None, attention_bias=False,
              attention_dropout=0.0)
DEFAULT_ROPE = dict(rope_type="llama3", rope_theta=12000000.0, factor=8.0, original_max_position_embeddings=8192,
                    low_freq_factor=1.0, high_freq_factor=4.0)
FEATURES = (llama.ROTARY - {"gated_mlp"}) | {"plain_mlp", "xielu", "qk_norm_head", "attention_bias",
                                             "attention_out_bias"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    if hf.get("rope_parameters") is None and hf.get("rope_scaling", None) is None:
        rotary = rope(hf, params=DEFAULT_ROPE)  # ApertusConfig's default, not rope_theta's
    else:
        rotary = rope(hf, theta=DEFAULT_ROPE["rope_theta"])
    rotary.pop("partial_rotary_factor")  # whole heads rotate
    bias = hf.get("attention_bias")  # q/k/v and o
    return sizes(hf) | rotary | dict(mlp_type="plain", qk_norm="head", attention_bias=bias,
                                     attention_out_bias=bias)


def to_hf(a) -> dict:
    return sizes_to_hf(a) | dict(rope_parameters=rope_parameters_to_hf(a), attention_bias=a.attention_bias)


def xielu_weights(a, prefix: str = "mlp.") -> list[Weight]:
    """xIELU's four scalars of a layer's MLP (``act_fn``: alpha_p and alpha_n of shape [1])."""
    if a.hidden_act != "xielu":
        return []
    h = llama.LAYER + prefix + "act_fn."
    return [Weight(("mlp", "xielu", n), h + n, "vec" if n.startswith("alpha") else "copy")
            for n in ("alpha_p", "alpha_n", "beta", "eps")]


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    norms = [Weight(("attn_norm", "scale"), h + "attention_layernorm.weight"),
             Weight(("mlp_norm", "scale"), h + "feedforward_layernorm.weight")]
    attention = [w for w in llama.attention_weights(a) if w.path[0] not in ("attn_norm", "mlp_norm")]
    return norms + attention + llama.mlp_weights(a) + xielu_weights(a)


BASE = dict(mlp_type="plain", hidden_act="xielu", qk_norm="head", rms_norm_eps=1e-5, rope_theta=12000000.0,
            rope_scaling={k: v for k, v in DEFAULT_ROPE.items() if k != "rope_theta"})
APERTUS = Family(
    "apertus", ("apertus",), "ApertusForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights,
    presets={
        # swiss-ai/Apertus-8B-2509/config.json (as several independent copies state it: 8 kv heads,
        # 21504 wide; bos/eos ApertusConfig's)
        "apertus-8b": BASE | dict(vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=65536,
                                  bos_token_id=1, eos_token_id=2),
        "apertus-tiny": llama.TINY | BASE,
    })


# ------------------------------------------------ Apertus 1.5's text model (apertus1p5_text)
SCHEMA_1P5 = SCHEMA | dict(vocab_size=266752, output_vocab_size=None)


def from_hf_1p5(hf: HFConfig) -> dict:
    """Apertus' fields; the LM head pruned to the first ``output_vocab_size`` ids (the text ids of
    the extended vocabulary) is refused: shardzoo's head is as wide as the embeddings."""
    out = hf.get("output_vocab_size")
    if out is not None and out != hf.get("vocab_size"):
        raise hf.refuse("output_vocab_size", f"an LM head of fewer rows than vocab_size={hf.get('vocab_size')} "
                                             "is not implemented (shardzoo's head is as wide as the embeddings)")
    return from_hf(hf)


# Apertus 1.5 (swiss-ai/Apertus-v1.5-*): Apertus with a vocabulary extended by visual and audio
# code ids; its text model under its own model_type (Apertus1p5TextForCausalLM)
APERTUS1P5_TEXT = Family(
    "apertus1p5_text", ("apertus1p5_text",), "Apertus1p5TextForCausalLM", SCHEMA_1P5, FEATURES, from_hf_1p5,
    to_hf, llama.global_weights, layer_weights)
