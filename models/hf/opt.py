"""OPT (Meta): a learned position table read at position + 2 (``position_offset``: two rows
before position 0), q/k/v/out and MLP (``fc1``, ``fc2``) biases with ``enable_bias``, a plain
ReLU MLP ``ffn_dim`` wide, LayerNorms before attention and MLP and at the end, a tied output head.

The post-norm OPT-350m (``do_layer_norm_before`` false: x = LN(x + attn(x))) and its embeddings
projected in and out (``word_embed_proj_dim`` other than ``hidden_size``) are refused, naming the
field: neither block form is a component yet.
"""

from __future__ import annotations

from shardzoo.models.hf import phi
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, special_tokens

PREFIX = "model.decoder."
# OPTConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=50272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072, max_position_embeddings=2048,
              do_layer_norm_before=True, _remove_final_layer_norm=False, word_embed_proj_dim=None, dropout=0.1,
              attention_dropout=0.0, num_attention_heads=12, activation_function="relu", layerdrop=0.0,
              init_std=0.02, use_cache=True, pad_token_id=1, bos_token_id=2, eos_token_id=2, enable_bias=True,
              layer_norm_elementwise_affine=True, tie_word_embeddings=True)
FEATURES = frozenset({"learned_positions", "position_offset", "layernorm", "pre_norms", "plain_mlp",
                      "attention_bias", "attention_out_bias", "mlp_bias"})
OFFSET = 2  # OPTLearnedPositionalEmbedding's


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "dropout", "layerdrop")
    d, proj = hf.get("hidden_size"), hf.get("word_embed_proj_dim")
    if proj not in (None, d):
        raise hf.refuse("word_embed_proj_dim", f"embeddings projected to hidden_size={d} (project_in/out) are not "
                                               "implemented; only word_embed_proj_dim = hidden_size")
    bias = hf.get("enable_bias")
    return dict(vocab_size=hf.get("vocab_size"), hidden_size=d, intermediate_size=hf.get("ffn_dim"),
                num_hidden_layers=hf.get("num_hidden_layers"), num_attention_heads=hf.get("num_attention_heads"),
                max_position_embeddings=hf.get("max_position_embeddings"), rms_norm_eps=1e-5,
                hidden_act=hf.get("activation_function"), mlp_type="plain", position_embedding="learned",
                position_offset=OFFSET, norm_type="layernorm", attention_bias=bias, attention_out_bias=bias,
                mlp_bias=bias, tie_word_embeddings=hf.get("tie_word_embeddings"),
                initializer_range=hf.get("init_std"), **special_tokens(hf))


def to_hf(a) -> dict:
    return dict(hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers, ffn_dim=a.intermediate_size,
                max_position_embeddings=a.max_position_embeddings, num_attention_heads=a.num_attention_heads,
                activation_function=a.hidden_act, enable_bias=a.attention_bias, word_embed_proj_dim=a.hidden_size,
                init_std=a.initializer_range)


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "embed_tokens.weight"),
           Weight(("pos_embed", "embedding"), PREFIX + "embed_positions.weight")]
    out += phi._both(("final_norm",), PREFIX + "final_layer_norm")
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "lm_head.weight", "linear")]


def _linear(path, name, bias: bool, n_in: int = 1) -> list[Weight]:
    out = [Weight(path + ("kernel",), name + ".weight", "linear", n_in=n_in)]
    return out + [Weight(path + ("bias",), name + ".bias", "vec")] if bias else out


def layer_weights(a, spec) -> list[Weight]:
    h = PREFIX + "layers.{i}."
    out = phi._both(("attn_norm",), h + "self_attn_layer_norm") + phi._both(("mlp_norm",), h + "final_layer_norm")
    for n in "qkv":
        out += _linear(("attn", n), h + f"self_attn.{n}_proj", a.attention_bias)
    out += _linear(("attn", "o"), h + "self_attn.out_proj", a.attention_out_bias, n_in=2)
    return out + _linear(("mlp", "up"), h + "fc1", a.mlp_bias) + _linear(("mlp", "down"), h + "fc2", a.mlp_bias)


BASE = dict(position_embedding="learned", position_offset=OFFSET, norm_type="layernorm", mlp_type="plain",
            hidden_act="relu", rms_norm_eps=1e-5, attention_bias=True, attention_out_bias=True, mlp_bias=True,
            tie_word_embeddings=True, max_position_embeddings=2048, vocab_size=50272, bos_token_id=2,
            eos_token_id=2)
OPT = Family(
    "opt", ("opt",), "OPTForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        # facebook/opt-125m/config.json and facebook/opt-1.3b/config.json
        "opt-125m": BASE | dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
        "opt-1.3b": BASE | dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                num_attention_heads=32),
        "opt-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=256, bos_token_id=None,
                                eos_token_id=None),
    })
