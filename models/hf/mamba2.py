"""Mamba2 (``mamba2``): every layer a Mamba2 state-space mixer after one RMSNorm, no MLP and no
attention (``layer_types`` "mamba", ``mlp_layer_types`` "none"); the mixer is the shared
``mamba2`` feature (``models/ssm.py``). Also the shared pieces of the families with Mamba2
layers (Bamba, Nemotron-H): the mixer's fields read from config.json and its weight map.
"""

from __future__ import annotations

import math

from shardzoo.models.arch import MAMBA, NONE
from shardzoo.models.hf.base import Family, HFConfig, Weight, special_tokens

# Mamba2Config's fields and transformers' defaults
SCHEMA = dict(num_heads=128, head_dim=64, vocab_size=32768, hidden_size=4096, state_size=128, num_hidden_layers=64,
              layer_norm_epsilon=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2, expand=2, conv_kernel=4,
              n_groups=8, use_bias=False, use_conv_bias=True, hidden_act="silu", initializer_range=0.1,
              residual_in_fp32=True, time_step_rank="auto", time_step_min=0.001, time_step_max=0.1,
              time_step_floor=1e-4, time_step_limit=[0.0, math.inf], rescale_prenorm_residual=False, use_cache=True,
              chunk_size=256, tie_word_embeddings=False)
# rope and gated_mlp: the record's defaults for its absent attention and MLP
FEATURES = frozenset({"rope", "gated_mlp", "rmsnorm", "pre_norms", "layer_pattern", "mlp_free_layers", "mamba2", "mamba_proj_bias",
                      "time_step_limit"})
# the attention fields of a model without attention layers (its intermediate_size, without MLPs,
# stays the default)
NO_ATTENTION = dict(num_attention_heads=1, num_key_value_heads=None, head_dim=None)
# settings of the initialisation only, and residual_in_fp32 (a float32 residual: shardzoo's in float32)
_INIT = ("time_step_rank", "time_step_min", "time_step_max", "time_step_floor", "rescale_prenorm_residual",
         "residual_in_fp32", "use_cache", "pad_token_id", "use_mamba_kernels")


def mamba_fields(hf: HFConfig, names: dict) -> dict:
    """The mixer's architecture fields from config.json; ``names``: the family's name of each
    (heads, head_dim, groups, state, conv, chunk, conv_bias, proj_bias, expand, act, limit;
    expand None: the family has none, its inner width is heads x head_dim; an optional "inner":
    the key of an explicit inner width, which, when set, replaces expand x hidden_size: Falcon-H1's
    mamba_d_ssm)."""
    get = lambda key: hf.get(names[key])  # noqa: E731
    heads, head_dim, hidden = get("heads"), get("head_dim"), hf.get("hidden_size")
    expand = get("expand") if names["expand"] else None
    inner = get("inner") if names.get("inner") else None
    width, why = (inner, names.get("inner")) if inner is not None else (
        None if expand is None else expand * hidden, f"{names['expand']} x hidden_size")
    if head_dim == "auto":  # Bamba's default: the inner width over the heads
        head_dim = width // heads
    if width is not None and heads * head_dim != width:
        raise hf.refuse(names["heads"], f"{names['heads']} x {names['head_dim']} = {heads * head_dim} must be "
                                        f"{why} = {width}")
    if get("act") != "silu":
        raise hf.refuse(names["act"], "the mamba mixer's activation is SiLU")
    limit = get("limit")
    return dict(mamba_num_heads=heads, mamba_head_dim=head_dim, mamba_n_groups=get("groups"),
                ssm_state_size=get("state"), mamba_conv_kernel=get("conv"), mamba_chunk_size=get("chunk"),
                mamba_conv_bias=get("conv_bias"), mamba_proj_bias=get("proj_bias"),
                time_step_limit=(0.0, math.inf) if limit is None else tuple(_number(v) for v in limit))


def _number(value) -> float:
    """A float of config.json: transformers 5 writes infinity as ``{"__float__": "Infinity"}``."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def mamba_to_hf(a, names: dict) -> dict:
    return {names["heads"]: a.mamba.num_heads, names["head_dim"]: a.mamba.head_dim,
            names["groups"]: a.mamba.n_groups, names["state"]: a.mamba.state_size, names["conv"]: a.mamba.conv_kernel,
            names["chunk"]: a.mamba.chunk_size, names["conv_bias"]: a.mamba.conv_bias,
            names["proj_bias"]: a.mamba.proj_bias, names["limit"]: list(a.mamba.time_step_limit),  # inf: JSON's Infinity
            **({names["expand"]: a.mamba.inner // a.hidden_size} if names["expand"] else {})}


def mamba_weights(a, m: str) -> list[Weight]:
    """A mixer's tensors under prefix ``m`` (transformers' Mamba2Mixer: in_proj rows z | x | B |
    C | dt; conv1d's channels x | B | C)."""
    hp, gn, h = a.mamba.inner, a.mamba.n_groups * a.mamba.state_size, a.mamba.num_heads
    proj, conv = (hp, hp, gn, gn, h), (hp, gn, gn)
    out = []
    for j, n in enumerate(("z", "x", "b", "c", "dt")):
        out.append(Weight(("mamba", f"in_{n}", "kernel"), m + "in_proj.weight", "linear", part=(j, 5), widths=proj))
        if a.mamba.proj_bias:
            out.append(Weight(("mamba", f"in_{n}", "bias"), m + "in_proj.bias", "vec", part=(j, 5), widths=proj))
    for j, n in enumerate("xbc"):
        out.append(Weight(("mamba", f"conv_{n}"), m + "conv1d.weight", "depthwise", part=(j, 3), widths=conv))
        if a.mamba.conv_bias:
            out.append(Weight(("mamba", f"conv_{n}_bias"), m + "conv1d.bias", "vec", part=(j, 3), widths=conv))
    out += [Weight(("mamba", n), m + n) for n in ("dt_bias", "A_log", "D")]
    if a.mamba.norm != "none":
        out.append(Weight(("mamba", "norm"), m + "norm.weight", "vec"))
    out.append(Weight(("mamba", "out", "kernel"), m + "out_proj.weight", "linear", n_in=2))
    if a.mamba.proj_bias:
        out.append(Weight(("mamba", "out", "bias"), m + "out_proj.bias", "vec"))
    return out


NAMES = dict(heads="num_heads", head_dim="head_dim", groups="n_groups", state="state_size", conv="conv_kernel",
             chunk="chunk_size", conv_bias="use_conv_bias", proj_bias="use_bias", expand="expand", act="hidden_act",
             limit="time_step_limit")


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*(k for k in _INIT if k in SCHEMA))
    hf.require("hidden_size", "num_hidden_layers")
    n = hf.get("num_hidden_layers")
    return NO_ATTENTION | special_tokens(hf) | mamba_fields(hf, NAMES) | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=hf.get("hidden_size"), num_hidden_layers=n,
        rms_norm_eps=hf.get("layer_norm_epsilon"), initializer_range=hf.get("initializer_range"),
        tie_word_embeddings=hf.get("tie_word_embeddings"), layer_types=(MAMBA,) * n, mlp_layer_types=(NONE,) * n)


def to_hf(a) -> dict:
    return mamba_to_hf(a, NAMES) | dict(hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
                                        layer_norm_epsilon=a.rms_norm_eps, hidden_act="silu")


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), "backbone.embeddings.weight"),
           Weight(("final_norm", "scale"), "backbone.norm_f.weight")]
    if not a.tie_word_embeddings:
        out.append(Weight(("lm_head", "kernel"), "lm_head.weight", "linear"))
    return out


def layer_weights(a, spec) -> list[Weight]:
    h = "backbone.layers.{i}."
    return [Weight(("attn_norm", "scale"), h + "norm.weight")] + mamba_weights(a, h + "mixer.")


def _mamba2(n: int, **fields) -> dict:
    return NO_ATTENTION | dict(num_hidden_layers=n, layer_types=(MAMBA,) * n, mlp_layer_types=(NONE,) * n,
                               rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0) | fields


# --------------------------------------------------------------------------------- presets
# state-spaces/mamba2-130m (transformers' Mamba2 conversion): 24 layers of width 768, 24 heads
# of 64, one group, state 128, tied embeddings, vocab 50288
MAMBA2 = Family(
    "mamba2", ("mamba2",), "Mamba2ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        "mamba2-130m": _mamba2(24, vocab_size=50288, hidden_size=768, mamba_num_heads=24, mamba_head_dim=64,
                               mamba_n_groups=1, ssm_state_size=128, mamba_chunk_size=256, tie_word_embeddings=True,
                               initializer_range=0.1),
        "mamba2-tiny": _mamba2(2, vocab_size=512, hidden_size=64, mamba_num_heads=8, mamba_head_dim=16,
                               mamba_n_groups=2, ssm_state_size=16, mamba_chunk_size=64, bos_token_id=None,
                               eos_token_id=None),
    })
