"""XGLM (Meta): fixed sinusoidal positions read at position + 2 (``position_offset``), token
embeddings scaled by sqrt(d_model) (``scale_embedding``), and OPT's layers under the same names
(``models/hf/opt.py``: biased q/k/v/out, ``fc1``/``fc2``, LayerNorms before attention and MLP),
a final ``layer_norm``, a tied output head.

The sinusoids' row ``pad_token_id`` is zero in transformers: a pad id of 2 or more (a position
p = pad_token_id - 2 without its embedding) is refused.
"""

from __future__ import annotations

from shardzoo.models.hf import opt, phi
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, renamed, special_tokens

PREFIX = "model."
# XGLMConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=256008, max_position_embeddings=2048, d_model=1024, ffn_dim=4096, num_layers=24,
              attention_heads=16, activation_function="gelu", dropout=0.1, attention_dropout=0.1,
              activation_dropout=0.0, layerdrop=0.0, init_std=0.02, scale_embedding=True, use_cache=True,
              decoder_start_token_id=2, pad_token_id=1, bos_token_id=0, eos_token_id=2, add_cross_attention=False,
              tie_word_embeddings=True)
ALIASES = {"hidden_size": "d_model", "num_attention_heads": "attention_heads", "num_hidden_layers": "num_layers"}
FEATURES = frozenset({"sinusoidal_positions", "position_offset", "scale_embeddings", "layernorm", "pre_norms",
                      "plain_mlp", "attention_bias", "attention_out_bias", "mlp_bias"})


def from_hf(hf: HFConfig) -> dict:
    hf.unalias(ALIASES)
    hf.ignore(*INERT, "dropout", "activation_dropout", "layerdrop", "decoder_start_token_id")
    pad = hf.get("pad_token_id")
    if isinstance(pad, int) and pad >= opt.OFFSET:
        raise hf.refuse("pad_token_id", f"transformers zeroes the sinusoid of position {pad - opt.OFFSET} "
                                        f"(row pad_token_id of a table offset by {opt.OFFSET}); only 0, 1 or null")
    return dict(vocab_size=hf.get("vocab_size"), hidden_size=hf.get("d_model"), intermediate_size=hf.get("ffn_dim"),
                num_hidden_layers=hf.get("num_layers"), num_attention_heads=hf.get("attention_heads"),
                max_position_embeddings=hf.get("max_position_embeddings"), rms_norm_eps=1e-5,
                hidden_act=hf.get("activation_function"), mlp_type="plain", position_embedding="sinusoidal",
                position_offset=opt.OFFSET, scale_embeddings=hf.get("scale_embedding"), norm_type="layernorm",
                attention_bias=True, attention_out_bias=True, mlp_bias=True,
                tie_word_embeddings=hf.get("tie_word_embeddings"), initializer_range=hf.get("init_std"),
                **special_tokens(hf))


def to_hf(a) -> dict:
    return dict(d_model=a.hidden_size, ffn_dim=a.intermediate_size, num_layers=a.num_hidden_layers,
                attention_heads=a.num_attention_heads, max_position_embeddings=a.max_position_embeddings,
                activation_function=a.hidden_act, scale_embedding=a.scale_embeddings, init_std=a.initializer_range)


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "embed_tokens.weight")] + phi._both(("final_norm",), PREFIX + "layer_norm")
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "lm_head.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    return renamed(opt.layer_weights(a, spec), ((opt.PREFIX, PREFIX),))


BASE = dict(position_embedding="sinusoidal", position_offset=opt.OFFSET, scale_embeddings=True, norm_type="layernorm",
            mlp_type="plain", hidden_act="gelu", rms_norm_eps=1e-5, attention_bias=True, attention_out_bias=True,
            mlp_bias=True, tie_word_embeddings=True, max_position_embeddings=2048, bos_token_id=0, eos_token_id=2)
XGLM = Family(
    "xglm", ("xglm",), "XGLMForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        # facebook/xglm-564M/config.json
        "xglm-564m": BASE | dict(vocab_size=256008, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                 num_attention_heads=16),
        "xglm-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=256, bos_token_id=None,
                                 eos_token_id=None),
    })
