"""BioGPT (Microsoft): OPT's learned positions read at position + 2 (``position_offset``) and its
layers under the same names (``models/hf/opt.py``), token embeddings scaled by
sqrt(hidden_size) (``scale_embedding``), a plain GELU MLP, a final ``layer_norm`` and a tied
``output_projection``. transformers builds its LayerNorms with torch's epsilon (1e-5), whatever
``layer_norm_eps`` says.
"""

from __future__ import annotations

from shardzoo.models.hf import opt, phi
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, renamed, special_tokens

PREFIX = "biogpt."
# BioGptConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=42384, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
              intermediate_size=4096, hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
              max_position_embeddings=1024, initializer_range=0.02, layer_norm_eps=1e-12, scale_embedding=True,
              use_cache=True, layerdrop=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
              tie_word_embeddings=True)
FEATURES = opt.FEATURES | {"scale_embeddings"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "hidden_dropout_prob", "attention_probs_dropout_prob", "layerdrop", "activation_dropout",
              "layer_norm_eps")  # the last: not read by transformers' model
    return dict(vocab_size=hf.get("vocab_size"), hidden_size=hf.get("hidden_size"),
                intermediate_size=hf.get("intermediate_size"), num_hidden_layers=hf.get("num_hidden_layers"),
                num_attention_heads=hf.get("num_attention_heads"),
                max_position_embeddings=hf.get("max_position_embeddings"), rms_norm_eps=1e-5,
                hidden_act=hf.get("hidden_act"), mlp_type="plain", position_embedding="learned",
                position_offset=opt.OFFSET, scale_embeddings=hf.get("scale_embedding"), norm_type="layernorm",
                attention_bias=True, attention_out_bias=True, mlp_bias=True,
                tie_word_embeddings=hf.get("tie_word_embeddings"), initializer_range=hf.get("initializer_range"),
                **special_tokens(hf))


def to_hf(a) -> dict:
    return dict(hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
                max_position_embeddings=a.max_position_embeddings, hidden_act=a.hidden_act,
                scale_embedding=a.scale_embeddings)


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "embed_tokens.weight"),
           Weight(("pos_embed", "embedding"), PREFIX + "embed_positions.weight")]
    out += phi._both(("final_norm",), PREFIX + "layer_norm")
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "output_projection.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    return renamed(opt.layer_weights(a, spec), ((opt.PREFIX, PREFIX),))


BASE = dict(position_embedding="learned", position_offset=opt.OFFSET, scale_embeddings=True, norm_type="layernorm",
            mlp_type="plain", hidden_act="gelu", rms_norm_eps=1e-5, attention_bias=True, attention_out_bias=True,
            mlp_bias=True, tie_word_embeddings=True, bos_token_id=0, eos_token_id=2)
BIOGPT = Family(
    "biogpt", ("biogpt",), "BioGptForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        # microsoft/biogpt/config.json
        "biogpt": BASE | dict(vocab_size=42384, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                              num_attention_heads=16, max_position_embeddings=1024),
        "biogpt-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=256, bos_token_id=None,
                                   eos_token_id=None),
    })
