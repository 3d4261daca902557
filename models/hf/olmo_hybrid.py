"""OLMo hybrid (``olmo_hybrid``): Gated DeltaNet layers beside OLMo 3's attention layers, by
``layer_types`` ("linear_attention", "full_attention"; transformers' default: every 4th attends).

An attention layer is OLMo 3's without a window: norms on the outputs (``post_attention_layernorm``,
``post_feedforward_layernorm``), qk-norm over the whole q and k projections. A linear-attention
layer is Llama's pre-norm layer around the shared ``gated_deltanet`` mixer
(``models/linear_attention.py``) with q, k, v, a, b and g (the output gate, Qwen3-Next's z) each
its own projection, the rate doubled where ``linear_allow_neg_eigval`` (beta in [0, 2]) and its
gated norm at epsilon 1e-5 (FLA's, whatever ``rms_norm_eps`` is): the per-layer norm placement is
``norm_positions``. Rotary embeddings on the attention layers unless ``rope_parameters`` gives
``rope_theta: null`` (the released checkpoints: NoPE).
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, LINEAR
from shardzoo.models.hf import llama
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    layer_types,
    rope,
    rope_parameters_to_hf,
    sizes,
    sizes_to_hf,
)

NORM_EPS = 1e-5  # the Gated DeltaNet's gated norm (FLA's FusedRMSNormGated default)
# OlmoHybridConfig's fields and transformers' defaults (transformers 5.25: allenai/Olmo-Hybrid-7B's shape)
SCHEMA = dict(vocab_size=100352, hidden_size=3840, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=30, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=65536,
              initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, pad_token_id=100277, bos_token_id=None,
              eos_token_id=100257, tie_word_embeddings=False, rope_parameters=None, attention_bias=False,
              attention_dropout=0.0, layer_types=None, linear_num_key_heads=None, linear_num_value_heads=None,
              linear_key_head_dim=None, linear_value_head_dim=None, linear_a_log_min=0.0, linear_a_log_max=16.0,
              linear_dt_min=0.001, linear_dt_max=0.1, linear_dt_init_floor=1e-4, linear_conv_kernel_dim=4,
              linear_allow_neg_eigval=True)
_INIT_ONLY = ("linear_a_log_min", "linear_a_log_max", "linear_dt_min", "linear_dt_max", "linear_dt_init_floor")
FEATURES = llama.ROTARY | {
    "post_norms", "norm_position_pattern", "qk_norm_projection", "attention_bias", "attention_out_bias",
    "layer_pattern", "nope_layers", "gated_deltanet", "delta_negative_eigenvalues", "delta_norm_eps"}


def _types(hf: HFConfig, n: int) -> tuple[str, ...]:
    types = hf.get("layer_types")
    if types is None:  # transformers: every 4th layer attends, the last one at least
        types = [FULL if i % 4 == 3 else LINEAR for i in range(n)]
        if FULL not in types:
            types[-1] = FULL
    if any(t not in (FULL, LINEAR) for t in types) or FULL not in types or LINEAR not in types:
        raise hf.refuse("layer_types", f"OLMo hybrid's layers are {FULL!r} and {LINEAR!r}, at least one of each")
    return tuple(types)


def _linear(hf: HFConfig, out: dict) -> dict:
    """The Gated DeltaNet's sizes, transformers' defaults where config.json has none."""
    nk = hf.get("linear_num_key_heads") or out["num_attention_heads"]
    nv = hf.get("linear_num_value_heads") or out["num_attention_heads"]
    dk = hf.get("linear_key_head_dim") or int(0.75 * out["hidden_size"] / nk)
    return dict(linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
                linear_value_head_dim=hf.get("linear_value_head_dim") or 2 * dk,
                linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim"),
                linear_allow_neg_eigval=bool(hf.get("linear_allow_neg_eigval")), linear_norm_eps=NORM_EPS)


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, *_INIT_ONLY)
    out = sizes(hf)
    if out["hidden_act"] != "silu":
        raise hf.refuse("hidden_act", "the Gated DeltaNet's convolution is followed by SiLU; shardzoo reads 'silu'")
    types = _types(hf, out["num_hidden_layers"])
    params = hf.get("rope_parameters")
    nope = isinstance(params, dict) and "rope_theta" in params and params["rope_theta"] is None
    out |= dict(rope_theta=10000.0, rope_scaling=None) if nope else rope(hf, theta=10000.0)
    bias = hf.get("attention_bias")
    return out | _linear(hf, out) | dict(
        layer_types=types, norm_positions=tuple("post" if t == FULL else "pre" for t in types),
        rope_layers=(False,) * len(types) if nope else None, qk_norm="projection", attention_bias=bias,
        attention_out_bias=bias)


def to_hf(a) -> dict:
    out = sizes_to_hf(a)
    del out["head_dim"]  # hidden_size / num_attention_heads: OlmoHybridConfig has no head_dim
    la = a.linear_attention.flat()
    nope = a.rope_layers is not None and not any(a.rope_layers)
    return out | {k: v for k, v in la.items() if k != "linear_norm_eps"} | dict(
        layer_types=layer_types(a), attention_bias=a.attention_bias, pad_token_id=None,  # not transformers' 100277
        rope_parameters=dict(rope_type="default", rope_theta=None) if nope else rope_parameters_to_hf(a))


# --------------------------------------------------------------------------------- weights
def linear_attention_weights(a) -> list[Weight]:
    """The Gated DeltaNet's tensors: a projection each, conv1d's channels q | k | v."""
    x = llama.LAYER + "linear_attn."
    la = a.linear_attention
    keys, values = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
    names = dict(q="q_proj", k="k_proj", v="v_proj", z="g_proj", b="b_proj", a="a_proj")
    out = [Weight(("linear_attn", n, "kernel"), x + f"{hf}.weight", "linear") for n, hf in names.items()]
    pieces = tuple(x + f"{n}_conv1d.weight" for n in "qkv")  # stored apart (transformers joins them)
    out += [Weight(("linear_attn", f"conv_{n}"), x + "conv1d.weight", "depthwise", part=(j, 3),
                   widths=(keys, keys, values), pieces=pieces) for j, n in enumerate("qkv")]
    return out + [Weight(("linear_attn", "A_log"), x + "A_log"), Weight(("linear_attn", "dt_bias"), x + "dt_bias"),
                  Weight(("linear_attn", "norm"), x + "o_norm.weight"),
                  Weight(("linear_attn", "out", "kernel"), x + "o_proj.weight", "linear", n_in=2)]


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    if spec.mixer == LINEAR:
        norms = [Weight(("attn_norm", "scale"), h + "attention_layer_norm.weight"),
                 Weight(("mlp_norm", "scale"), h + "feedforward_layer_norm.weight")]
        mixer = linear_attention_weights(a)
    else:
        norms = [Weight(("post_attn_norm", "scale"), h + "feedforward_layer_norm.weight"),
                 Weight(("post_mlp_norm", "scale"), h + "post_feedforward_layernorm.weight")]
        mixer = [w for w in llama.attention_weights(a) if "layernorm" not in w.name]
    return norms + mixer + llama.mlp_weights(a)


# --------------------------------------------------------------------------------- presets
def _pattern(types) -> dict:
    return dict(layer_types=types, norm_positions=tuple("post" if t == FULL else "pre" for t in types))


BASE = dict(qk_norm="projection", linear_allow_neg_eigval=True, linear_norm_eps=NORM_EPS, linear_conv_kernel_dim=4)
OLMO_HYBRID = Family(
    "olmo_hybrid", ("olmo_hybrid",), "OlmoHybridForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights,
    presets={
        # OlmoHybridConfig's defaults (transformers documents them as allenai/Olmo-Hybrid-7B's; its
        # own config.json was not at hand): 32 layers, 3 Gated DeltaNet : 1 attention, NoPE
        "olmo-hybrid-7b": BASE | _pattern((LINEAR, LINEAR, LINEAR, FULL) * 8) | dict(
            vocab_size=100352, hidden_size=3840, intermediate_size=11008, num_hidden_layers=32,
            num_attention_heads=30, max_position_embeddings=65536, rms_norm_eps=1e-6, bos_token_id=None,
            eos_token_id=100257, rope_layers=(False,) * 32, linear_num_key_heads=30, linear_num_value_heads=30,
            linear_key_head_dim=96, linear_value_head_dim=192),
        "olmo-hybrid-tiny": BASE | llama.TINY | _pattern((LINEAR, FULL)) | dict(
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12),
    })
