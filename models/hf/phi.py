"""Phi-1, Phi-1.5 and Phi-2: attention and MLP side by side from one LayerNorm
(``x + attn(ln(x)) + mlp(ln(x))``), rotary embeddings on part of each head
(``partial_rotary_factor``, 0.5 when config.json does not say), biases everywhere (q/k/v, the
output projection ``dense``, the MLP ``fc1``/``fc2`` and the output head), a plain GELU MLP, a
final LayerNorm, and optionally a LayerNorm of each query and key head (``qk_layernorm``)."""

from __future__ import annotations

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

SCHEMA = dict(vocab_size=51200, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
              num_attention_heads=32, num_key_value_heads=None, resid_pdrop=0.0, embd_pdrop=0.0,
              attention_dropout=0.0, hidden_act="gelu_new", max_position_embeddings=2048,
              initializer_range=0.02, layer_norm_eps=1e-5, use_cache=True, tie_word_embeddings=False,
              rope_parameters=None, qk_layernorm=False, bos_token_id=1, eos_token_id=2, pad_token_id=None)
FEATURES = frozenset({"rope", "rope_scaling:linear", "rope_scaling:llama3", "partial_rotary", "layernorm",
                      "pre_norms", "parallel_residual", "plain_mlp", "attention_bias", "attention_out_bias",
                      "mlp_bias", "lm_head_bias", "qk_norm_head"})
DEFAULT_ROTARY = 0.5  # PhiConfig's, where neither rope_parameters nor the top level has one


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    out = sizes(hf, "layer_norm_eps") | rope(hf, rotary=DEFAULT_ROTARY)
    return out | dict(norm_type="layernorm", mlp_type="plain", block_form="parallel", attention_bias=True,
                      attention_out_bias=True, mlp_bias=True, lm_head_bias=True,
                      qk_norm="head" if hf.get("qk_layernorm") else "none")


def to_hf(a) -> dict:
    out = sizes_to_hf(a) | rope_to_hf(a) | dict(layer_norm_eps=a.rms_norm_eps, qk_layernorm=a.qk_norm == "head",
                                                 partial_rotary_factor=a.partial_rotary_factor)
    del out["rms_norm_eps"]
    if a.head_dim is None:
        del out["head_dim"]  # PhiConfig has none: hidden_size / heads
    return out


PREFIX = "model."
LAYER = PREFIX + "layers.{i}."


def _both(path, name) -> list[Weight]:
    """A LayerNorm's (or a biased linear's) two tensors."""
    return [Weight(path + ("scale",), name + ".weight", "vec"), Weight(path + ("bias",), name + ".bias", "vec")]


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "embed_tokens.weight")]
    out += _both(("final_norm",), PREFIX + "final_layernorm")
    if a.tie_word_embeddings:
        out.append(Weight(("lm_head_bias",), "lm_head.bias", "vec"))
    else:
        out += [Weight(("lm_head", "kernel"), "lm_head.weight", "linear"),
                Weight(("lm_head", "bias"), "lm_head.bias", "vec")]
    return out


def layer_weights(a, spec) -> list[Weight]:
    h = LAYER
    out = _both(("attn_norm",), h + "input_layernorm")
    for n in "qkv":
        out += [Weight(("attn", n, "kernel"), h + f"self_attn.{n}_proj.weight", "linear"),
                Weight(("attn", n, "bias"), h + f"self_attn.{n}_proj.bias", "vec")]
    out += [Weight(("attn", "o", "kernel"), h + "self_attn.dense.weight", "linear", n_in=2),
            Weight(("attn", "o", "bias"), h + "self_attn.dense.bias", "vec")]
    if a.qk_norm == "head":
        out += _both(("attn", "q_norm"), h + "self_attn.q_layernorm")
        out += _both(("attn", "k_norm"), h + "self_attn.k_layernorm")
    for leaf, name in (("up", "fc1"), ("down", "fc2")):
        out += [Weight(("mlp", leaf, "kernel"), h + f"mlp.{name}.weight", "linear"),
                Weight(("mlp", leaf, "bias"), h + f"mlp.{name}.bias", "vec")]
    return out


BASE = dict(norm_type="layernorm", mlp_type="plain", block_form="parallel", hidden_act="gelu_new",
            rms_norm_eps=1e-5, attention_bias=True, attention_out_bias=True, mlp_bias=True, lm_head_bias=True,
            partial_rotary_factor=0.5)
# microsoft/phi-2/config.json
PHI_2 = BASE | dict(vocab_size=51200, hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
                    num_attention_heads=32, max_position_embeddings=2048, partial_rotary_factor=0.4,
                    bos_token_id=50256, eos_token_id=50256)
PHI = Family(
    "phi", ("phi",), "PhiForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={"phi-2": PHI_2,
             "phi-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=256, bos_token_id=None,
                                     eos_token_id=None)})
