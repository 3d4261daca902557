"""StarCoder2: Llama's attention (GQA, rotary, every layer in one window) with LayerNorms that
have biases, one ``use_bias`` flag for the q/k/v/o and MLP biases, and a plain MLP
(``mlp.c_fc``, GELU, ``mlp.c_proj``). Its dropout rates (``residual_dropout``,
``embedding_dropout``) are not applied, as no family's are."""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    rope,
    rope_to_hf,
    sizes,
    sizes_to_hf,
)

SCHEMA = dict(vocab_size=49152, hidden_size=3072, intermediate_size=12288, num_hidden_layers=30,
              num_attention_heads=24, num_key_value_heads=2, hidden_act="gelu_pytorch_tanh",
              max_position_embeddings=4096, initializer_range=0.018042, norm_epsilon=1e-5, use_cache=True,
              bos_token_id=50256, eos_token_id=50256, pad_token_id=None, rope_parameters=None,
              sliding_window=None, attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0,
              use_bias=True, tie_word_embeddings=True)
FEATURES = frozenset({"rope", "rope_scaling:linear", "rope_scaling:llama3", "layernorm", "pre_norms",
                      "plain_mlp", "attention_bias", "attention_out_bias", "mlp_bias", "sliding_window"})


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "residual_dropout", "embedding_dropout")
    bias = hf.get("use_bias")  # q/k/v, o and the MLP's
    out = sizes(hf, "norm_epsilon") | rope(hf) | dict(
        norm_type="layernorm", mlp_type="plain", sliding_window=hf.get("sliding_window"),
        attention_bias=bias, attention_out_bias=bias, mlp_bias=bias)
    out.pop("partial_rotary_factor")  # StarCoder2 rotates whole heads
    return out


def to_hf(a) -> dict:
    out = sizes_to_hf(a) | rope_to_hf(a) | dict(norm_epsilon=a.rms_norm_eps, use_bias=a.attention_bias,
                                                 sliding_window=a.sliding_window)
    del out["rms_norm_eps"]
    out.pop("partial_rotary_factor", None)
    return out


def global_weights(a) -> list[Weight]:
    return llama.global_weights(a) + [Weight(("final_norm", "bias"), "model.norm.bias", "vec")]


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    out = llama.attention_weights(a)  # the norms' weights, q/k/v/o and their biases
    out += [Weight((norm, "bias"), h + f"{name}.bias", "vec")
            for norm, name in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))]
    for leaf, name in (("up", "c_fc"), ("down", "c_proj")):
        out.append(Weight(("mlp", leaf, "kernel"), h + f"mlp.{name}.weight", "linear"))
        if a.mlp_bias:
            out.append(Weight(("mlp", leaf, "bias"), h + f"mlp.{name}.bias", "vec"))
    return out


BASE = dict(norm_type="layernorm", mlp_type="plain", hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-5,
            attention_bias=True, attention_out_bias=True, mlp_bias=True, tie_word_embeddings=True)
# bigcode/starcoder2-3b/config.json
STARCODER2_3B = BASE | dict(vocab_size=49152, hidden_size=3072, intermediate_size=12288, num_hidden_layers=30,
                            num_attention_heads=24, num_key_value_heads=2, max_position_embeddings=16384,
                            rope_theta=999999.4420358813, sliding_window=4096, initializer_range=0.018042,
                            bos_token_id=0, eos_token_id=0)
STARCODER2 = Family(
    "starcoder2", ("starcoder2",), "Starcoder2ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    global_weights, layer_weights,
    presets={"starcoder2-3b": STARCODER2_3B,
             "starcoder2-tiny": BASE | llama.TINY | dict(sliding_window=8)})
