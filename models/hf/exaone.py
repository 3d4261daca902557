"""EXAONE 3 and 3.5 (``exaone``): Llama's model (transformers computes it with LlamaForCausalLM)
under GPT-2-like names (``transformer.h.{i}.attn.attention.q_proj``, ``ln_1``, ``mlp.c_fc_0`` ...)
and config keys (``num_layers``, ``layer_norm_epsilon``, ``activation_function``: aliases of
Llama's, read either way); rotary base 500000 by default. One flag, ``attention_bias``, for
q/k/v/o biases, and ``mlp_bias``.
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig, Weight, renamed

# ExaoneConfig's fields and defaults (transformers 5.25: LlamaConfig's but these)
SCHEMA = ({k: v for k, v in llama.SCHEMA.items() if k != "pretraining_tp"}
          | dict(vocab_size=102400, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=361))
ALIASES = {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps", "activation_function": "hidden_act"}
# Llama's tensor names -> EXAONE's
_NAMES = (("model.embed_tokens.", "transformer.wte."), ("model.layers.", "transformer.h."),
          ("model.norm.", "transformer.ln_f."), (".self_attn.o_proj.", ".attn.attention.out_proj."),
          (".self_attn.", ".attn.attention."), (".input_layernorm.", ".ln_1."),
          (".post_attention_layernorm.", ".ln_2."), (".mlp.gate_proj.", ".mlp.c_fc_0."),
          (".mlp.up_proj.", ".mlp.c_fc_1."), (".mlp.down_proj.", ".mlp.c_proj."))


def from_hf(hf: HFConfig) -> dict:
    hf.unalias(ALIASES)  # the published config.json spells these the old way
    bias = hf.get("attention_bias")
    return llama.rotary_fields(hf, theta=500000.0) | dict(attention_bias=bias, attention_out_bias=bias,
                                                          mlp_bias=hf.get("mlp_bias"))


def _renamed(ws: list[Weight]) -> list[Weight]:
    return renamed(ws, _NAMES)


def global_weights(a) -> list[Weight]:
    return _renamed(llama.global_weights(a))


def layer_weights(a, spec) -> list[Weight]:
    return _renamed(llama.layer_weights(a, spec))


# transformers 5 has no ExaoneForCausalLM: AutoModelForCausalLM builds a LlamaForCausalLM
EXAONE = Family(
    "exaone", ("exaone",), "LlamaForCausalLM", SCHEMA, llama.LLAMA_FEATURES, from_hf, llama.llama_to_hf,
    global_weights, layer_weights,
    presets={
        # LGAI-EXAONE/EXAONE-3.0-7.8B-Instruct/config.json
        "exaone-3.0-7.8b": dict(vocab_size=102400, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                                rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=1, eos_token_id=361),
        "exaone-tiny": llama.TINY | dict(rope_theta=500000.0),
    })
