"""Persimmon (Adept): Phi's attention (biased q/k/v and output ``dense``, rotary embeddings on
the first ``partial_rotary_factor`` of each head, 0.5 when config.json names none, a LayerNorm of
each query and key head with ``qk_layernorm``) with q|k|v fused per head in ``query_key_value``
(each head's q, k and v in turn), in a sequential block of two LayerNorms, and a plain biased MLP
(``dense_h_to_4h``, ``dense_4h_to_h``; ``relu2`` by default); no output-head bias.
"""

from __future__ import annotations

from shardzoo.models.hf import phi
from shardzoo.models.hf.base import Family, HFConfig, Weight

# PersimmonConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=262144, hidden_size=4096, intermediate_size=16384, num_hidden_layers=36,
              num_attention_heads=64, hidden_act="relu2", max_position_embeddings=16384, initializer_range=0.02,
              layer_norm_eps=1e-5, use_cache=True, tie_word_embeddings=False, rope_parameters=None, qk_layernorm=True,
              hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=None, bos_token_id=1, eos_token_id=2)
FEATURES = phi.FEATURES - {"parallel_residual", "lm_head_bias"}
LAYER = phi.LAYER


def from_hf(hf: HFConfig) -> dict:
    return phi.from_hf(hf) | dict(block_form="sequential", lm_head_bias=False, num_key_value_heads=None)


def to_hf(a) -> dict:
    out = phi.to_hf(a)
    del out["num_key_value_heads"]
    return out


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), phi.PREFIX + "embed_tokens.weight")]
    out += phi._both(("final_norm",), phi.PREFIX + "final_layernorm")
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "lm_head.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    h, heads = LAYER, a.num_attention_heads
    out = phi._both(("attn_norm",), h + "input_layernorm") + phi._both(("mlp_norm",), h + "post_attention_layernorm")
    for j, n in enumerate("qkv"):
        out += [Weight(("attn", n, "kernel"), h + "self_attn.query_key_value.weight", "linear", part=(j, 3),
                       groups=heads),
                Weight(("attn", n, "bias"), h + "self_attn.query_key_value.bias", "vec", part=(j, 3), groups=heads)]
    out += [Weight(("attn", "o", "kernel"), h + "self_attn.dense.weight", "linear", n_in=2),
            Weight(("attn", "o", "bias"), h + "self_attn.dense.bias", "vec")]
    if a.qk_norm == "head":
        out += phi._both(("attn", "q_norm"), h + "self_attn.q_layernorm")
        out += phi._both(("attn", "k_norm"), h + "self_attn.k_layernorm")
    for leaf, name in (("up", "dense_h_to_4h"), ("down", "dense_4h_to_h")):
        out += [Weight(("mlp", leaf, "kernel"), h + f"mlp.{name}.weight", "linear"),
                Weight(("mlp", leaf, "bias"), h + f"mlp.{name}.bias", "vec")]
    return out


BASE = phi.BASE | dict(block_form="sequential", lm_head_bias=False, hidden_act="relu2", qk_norm="head")
PERSIMMON = Family(
    "persimmon", ("persimmon",), "PersimmonForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    global_weights, layer_weights,
    presets={"persimmon-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                           num_attention_heads=4, max_position_embeddings=256, bos_token_id=None,
                                           eos_token_id=None)})
