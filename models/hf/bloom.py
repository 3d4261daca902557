"""BLOOM (BigScience): ALiBi in place of position embeddings (``models/alibi.py``), a LayerNorm
of the embeddings (``word_embeddings_layernorm``), q|k|v fused per head in ``query_key_value``
(each head's q, k and v in turn, as Persimmon's), biases everywhere, a plain tanh-GELU MLP,
LayerNorms before attention and MLP and at the end, a tied output head.
``apply_residual_connection_post_layernorm`` (the normed input as the residual) is not read, so
any value but false is refused by the generic check; ``pretraining_tp`` and ``slow_but_exact``
only reorder sums.
"""

from __future__ import annotations

from shardzoo.models.hf import phi
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, special_tokens

PREFIX = "transformer."
# BloomConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=250880, hidden_size=64, n_layer=2, n_head=8, layer_norm_epsilon=1e-5, initializer_range=0.02,
              use_cache=True, bos_token_id=1, eos_token_id=2, pad_token_id=None,
              apply_residual_connection_post_layernorm=False, hidden_dropout=0.0, attention_dropout=0.0,
              pretraining_tp=1, slow_but_exact=False, tie_word_embeddings=True)
FEATURES = frozenset({"alibi", "embedding_norm", "layernorm", "pre_norms", "plain_mlp", "attention_bias",
                      "attention_out_bias", "mlp_bias"})


# the published config.json files' names (BloomConfig's attribute_map and its old n_embed)
ALIASES = {"n_embed": "hidden_size", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}


def from_hf(hf: HFConfig) -> dict:
    hf.unalias(ALIASES)
    hf.ignore(*INERT, "slow_but_exact")
    d = hf.get("hidden_size")
    return dict(vocab_size=hf.get("vocab_size"), hidden_size=d, intermediate_size=4 * d,
                num_hidden_layers=hf.get("n_layer"), num_attention_heads=hf.get("n_head"),
                rms_norm_eps=hf.get("layer_norm_epsilon"), hidden_act="gelu_new", mlp_type="plain",
                position_embedding="alibi", embedding_norm=True, norm_type="layernorm", attention_bias=True,
                attention_out_bias=True, mlp_bias=True, tie_word_embeddings=hf.get("tie_word_embeddings"),
                initializer_range=hf.get("initializer_range"), **special_tokens(hf))


def to_hf(a) -> dict:
    return dict(hidden_size=a.hidden_size, n_layer=a.num_hidden_layers, n_head=a.num_attention_heads,
                layer_norm_epsilon=a.rms_norm_eps)


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "word_embeddings.weight")]
    out += phi._both(("embed_norm",), PREFIX + "word_embeddings_layernorm") + phi._both(("final_norm",), PREFIX + "ln_f")
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "lm_head.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    h, heads = PREFIX + "h.{i}.", a.num_attention_heads
    out = phi._both(("attn_norm",), h + "input_layernorm") + phi._both(("mlp_norm",), h + "post_attention_layernorm")
    for j, n in enumerate("qkv"):
        out += [Weight(("attn", n, "kernel"), h + "self_attention.query_key_value.weight", "linear", part=(j, 3),
                       groups=heads),
                Weight(("attn", n, "bias"), h + "self_attention.query_key_value.bias", "vec", part=(j, 3),
                       groups=heads)]
    out += [Weight(("attn", "o", "kernel"), h + "self_attention.dense.weight", "linear", n_in=2),
            Weight(("attn", "o", "bias"), h + "self_attention.dense.bias", "vec")]
    for leaf, name in (("up", "dense_h_to_4h"), ("down", "dense_4h_to_h")):
        out += [Weight(("mlp", leaf, "kernel"), h + f"mlp.{name}.weight", "linear"),
                Weight(("mlp", leaf, "bias"), h + f"mlp.{name}.bias", "vec")]
    return out


BASE = dict(position_embedding="alibi", embedding_norm=True, norm_type="layernorm", mlp_type="plain",
            hidden_act="gelu_new", rms_norm_eps=1e-5, attention_bias=True, attention_out_bias=True, mlp_bias=True,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
BLOOM = Family(
    "bloom", ("bloom",), "BloomForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        # bigscience/bloom-560m/config.json (n_embed 1024, 24 layers, 16 heads)
        "bloom-560m": BASE | dict(vocab_size=250880, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                  num_attention_heads=16),
        "bloom-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, bos_token_id=None, eos_token_id=None),
    })
