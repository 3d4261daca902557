"""StableLM (StableLM-3B-4E1T, StableLM 2): Llama's layout with LayerNorms with bias (before
attention and MLP, and at the end), rotary embeddings on part of each head
(``partial_rotary_factor``, 0.25 when config.json does not say), q/k/v biases
(``use_qkv_bias``; never one on the output projection or the MLP), optionally a LayerNorm of
each query and key head with a weight per head and no bias (``qk_layernorm``: ``norms.{h}``
per head in HF), and optionally attention and MLP side by side from the one input LayerNorm
(``use_parallel_residual``: then no ``post_attention_layernorm``)."""

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

# StableLmConfig's fields and defaults (transformers 5)
SCHEMA = dict(vocab_size=50304, intermediate_size=6912, hidden_size=2560, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=4096,
              initializer_range=0.02, layer_norm_eps=1e-5, use_cache=True, tie_word_embeddings=False,
              rope_parameters=None, use_qkv_bias=False, qk_layernorm=False, use_parallel_residual=False,
              hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=None)
FEATURES = frozenset({"rope", "rope_scaling:linear", "rope_scaling:llama3", "partial_rotary", "layernorm",
                      "pre_norms", "parallel_residual", "gated_mlp", "attention_bias", "qk_norm_heads",
                      "qk_norm_no_bias"})
DEFAULT_ROTARY = 0.25  # StableLmConfig's, where neither rope_parameters nor the top level has one


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    out = sizes(hf, "layer_norm_eps") | rope(hf)
    given = dict(hf.get("rope_parameters") or {}) | hf.raw
    if given.get("partial_rotary_factor") is None:
        out["partial_rotary_factor"] = DEFAULT_ROTARY
    return out | dict(
        num_key_value_heads=hf.get("num_key_value_heads"),  # 32 when absent, as StableLmConfig
        head_dim=None,  # StableLM's attention: hidden_size / heads, whatever config.json says
        norm_type="layernorm", block_form="parallel" if hf.get("use_parallel_residual") else "sequential",
        attention_bias=hf.get("use_qkv_bias"),
        qk_norm="heads" if hf.get("qk_layernorm") else "none", qk_norm_no_bias=True)


def to_hf(a) -> dict:
    out = sizes_to_hf(a) | rope_to_hf(a) | dict(
        layer_norm_eps=a.rms_norm_eps, partial_rotary_factor=a.partial_rotary_factor,
        use_qkv_bias=a.attention_bias, qk_layernorm=a.qk_norm == "heads",
        use_parallel_residual=a.block_form == "parallel")
    for key in ("rms_norm_eps", "head_dim"):
        del out[key]  # head_dim: StableLmConfig has none (hidden_size / heads)
    return out


def _both(path, name) -> list[Weight]:
    """A LayerNorm's weight and bias."""
    return [Weight(path + ("scale",), name + ".weight"), Weight(path + ("bias",), name + ".bias")]


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), "model.embed_tokens.weight")] + _both(("final_norm",), "model.norm")
    if not a.tie_word_embeddings:
        out.append(Weight(("lm_head", "kernel"), "lm_head.weight", "linear"))
    return out


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    out = _both(("attn_norm",), h + "input_layernorm")
    if a.block_form == "sequential":
        out += _both(("mlp_norm",), h + "post_attention_layernorm")
    for n in "qkvo":
        out.append(Weight(("attn", n, "kernel"), h + f"self_attn.{n}_proj.weight", "linear",
                          n_in=2 if n == "o" else 1))
        if a.attention_bias and n != "o":
            out.append(Weight(("attn", n, "bias"), h + f"self_attn.{n}_proj.bias", "vec"))
    if a.qk_norm == "heads":  # one LayerNorm per head in HF, stacked [heads, head_dim] here
        for n, heads in (("q", a.num_attention_heads), ("k", a.kv_heads)):
            out.append(Weight(("attn", f"{n}_norm", "scale"), h + f"self_attn.{n}_layernorm.norms.{{e}}.weight",
                              experts=heads))
    return out + llama.mlp_weights(a)


BASE = dict(norm_type="layernorm", rms_norm_eps=1e-5, partial_rotary_factor=0.25, qk_norm_no_bias=True)
STABLELM = Family(
    "stablelm", ("stablelm",), "StableLmForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights,
    layer_weights,  # stablelm-tiny: StableLM 2's q/k/v biases and per-head qk LayerNorm (stablelm-2-12b's)
    presets={"stablelm-tiny": BASE | llama.TINY | dict(attention_bias=True, qk_norm="heads")})
