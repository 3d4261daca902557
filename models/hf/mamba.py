"""Mamba (``mamba``) and Falcon-Mamba (``falcon_mamba``): every layer a Mamba1 selective-scan
mixer (``models/mamba1.py``, layer type "mamba1") after one RMSNorm, no MLP and no attention;
Falcon-Mamba RMS-normalises dt, B and C without weights (``mixer_rms_eps``). The mixer's
inner width is config.json's ``intermediate_size`` where written (transformers reads it so:
falcon-mamba-7b says expand 16 beside intermediate_size 8192), else expand x hidden_size.
Also the mixer's fields and weight map for the other families with Mamba1 layers (Jamba).
"""

from __future__ import annotations

import math

from shardzoo.models.arch import NONE
from shardzoo.models.hf.base import Family, HFConfig, Weight, special_tokens
from shardzoo.models.hf.mamba2 import NO_ATTENTION, global_weights
from shardzoo.models.mamba1 import MAMBA1

# MambaConfig's fields and transformers' defaults (state-spaces/mamba-2.8b's)
SCHEMA = dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=32, layer_norm_epsilon=1e-5,
              pad_token_id=0, bos_token_id=0, eos_token_id=0, expand=2, conv_kernel=4, use_bias=False,
              use_conv_bias=True, hidden_act="silu", initializer_range=0.1, residual_in_fp32=True,
              time_step_rank="auto", time_step_scale=1.0, time_step_min=0.001, time_step_max=0.1,
              time_step_init_scheme="random", time_step_floor=1e-4, rescale_prenorm_residual=False, use_cache=True,
              use_mambapy=False, use_associative_scan=True, tie_word_embeddings=True, intermediate_size=None)
FALCON_SCHEMA = SCHEMA | dict(mixer_rms_eps=1e-6)
FEATURES = frozenset({"rope", "gated_mlp", "rmsnorm", "pre_norms", "layer_pattern", "mlp_free_layers", "mamba1"})
# the initialisation's settings, the kernels' choices and residual_in_fp32 (shardzoo's residual is float32 anyway)
_INIT = ("time_step_scale", "time_step_min", "time_step_max", "time_step_init_scheme", "time_step_floor",
         "rescale_prenorm_residual", "residual_in_fp32", "use_cache", "pad_token_id", "use_mambapy",
         "use_associative_scan")


def mamba1_fields(hf: HFConfig, names: dict) -> dict:
    """The mixer's record fields (flat names) from config.json; ``names``: the family's key of each
    (inner, expand, state, conv, rank, conv_bias, proj_bias, act)."""
    hidden = hf.get("hidden_size")
    expand, inner = hf.get(names["expand"]), hf.get(names["inner"]) if names["inner"] else None
    inner = int(expand * hidden) if inner is None else inner
    rank = hf.get(names["rank"])
    if hf.get(names["act"]) != "silu":
        raise hf.refuse(names["act"], "the mamba1 mixer's activation is SiLU")
    return dict(mamba1_intermediate_size=inner, mamba1_state_size=hf.get(names["state"]),
                mamba1_conv_kernel=hf.get(names["conv"]), mamba1_conv_bias=hf.get(names["conv_bias"]),
                mamba1_dt_rank=math.ceil(hidden / 16) if rank == "auto" else rank,
                mamba1_proj_bias=hf.get(names["proj_bias"]))


def mamba1_to_hf(a, names: dict) -> dict:
    m = a.mamba1
    out = {names["expand"]: max(1, m.intermediate_size // a.hidden_size), names["state"]: m.state_size,
           names["conv"]: m.conv_kernel, names["rank"]: m.dt_rank, names["conv_bias"]: m.conv_bias,
           names["proj_bias"]: m.proj_bias}
    return out | ({names["inner"]: m.intermediate_size} if names["inner"] else {})


def mamba1_weights(a, m: str) -> list[Weight]:
    """A mixer's tensors under prefix ``m`` (transformers' MambaMixer: in_proj rows x | z; x_proj
    rows dt | B | C; dt_proj's bias as dt_bias; Jamba's norms of dt, B, C)."""
    r, n = a.mamba1.dt_rank, a.mamba1.state_size
    out = [Weight(("mamba", f"in_{k}", "kernel"), m + "in_proj.weight", "linear", part=(j, 2))
           for j, k in enumerate("xz")]
    if a.mamba1.proj_bias:
        out += [Weight(("mamba", f"in_{k}", "bias"), m + "in_proj.bias", "vec", part=(j, 2)) for j, k in enumerate("xz")]
    out.append(Weight(("mamba", "conv"), m + "conv1d.weight", "depthwise"))
    if a.mamba1.conv_bias:
        out.append(Weight(("mamba", "conv_bias"), m + "conv1d.bias", "vec"))
    out += [Weight(("mamba", f"x_{k}", "kernel"), m + "x_proj.weight", "linear", part=(j, 3), widths=(r, n, n))
            for j, k in enumerate(("dt", "b", "c"))]
    out += [Weight(("mamba", "dt", "kernel"), m + "dt_proj.weight", "linear"),
            Weight(("mamba", "dt_bias"), m + "dt_proj.bias", "vec"),
            Weight(("mamba", "A_log"), m + "A_log"), Weight(("mamba", "D"), m + "D", "vec"),
            Weight(("mamba", "out", "kernel"), m + "out_proj.weight", "linear")]
    if a.mamba1.proj_bias:
        out.append(Weight(("mamba", "out", "bias"), m + "out_proj.bias", "vec"))
    if a.mamba1.bcdt_norm_weights:  # Jamba's
        out += [Weight(("mamba", f"{k}_norm"), m + f"{k}_layernorm.weight") for k in ("dt", "b", "c")]
    return out


NAMES = dict(inner="intermediate_size", expand="expand", state="state_size", conv="conv_kernel", rank="time_step_rank",
             conv_bias="use_conv_bias", proj_bias="use_bias", act="hidden_act")


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*_INIT)
    hf.require("hidden_size", "num_hidden_layers")
    n = hf.get("num_hidden_layers")
    fields = mamba1_fields(hf, NAMES)
    if "mixer_rms_eps" in hf.family.schema:  # Falcon-Mamba's norms of dt, B and C
        fields["mamba1_bcdt_rms_eps"] = hf.get("mixer_rms_eps")
    return NO_ATTENTION | special_tokens(hf) | fields | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=hf.get("hidden_size"), num_hidden_layers=n,
        rms_norm_eps=hf.get("layer_norm_epsilon"), initializer_range=hf.get("initializer_range"),
        tie_word_embeddings=hf.get("tie_word_embeddings"), layer_types=(MAMBA1,) * n, mlp_layer_types=(NONE,) * n)


def to_hf(a) -> dict:
    eps = {} if a.mamba1.bcdt_rms_eps is None else {"mixer_rms_eps": a.mamba1.bcdt_rms_eps}
    return mamba1_to_hf(a, NAMES) | eps | dict(hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
                                               layer_norm_epsilon=a.rms_norm_eps, hidden_act="silu")


def layer_weights(a, spec) -> list[Weight]:
    h = "backbone.layers.{i}."
    return [Weight(("attn_norm", "scale"), h + "norm.weight")] + mamba1_weights(a, h + "mixer.")


def _mamba(n: int, hidden: int, inner: int, rank: int, **fields) -> dict:
    return NO_ATTENTION | dict(num_hidden_layers=n, hidden_size=hidden, layer_types=(MAMBA1,) * n,
                               mlp_layer_types=(NONE,) * n, rms_norm_eps=1e-5, initializer_range=0.1,
                               mamba1_intermediate_size=inner, mamba1_dt_rank=rank, mamba1_state_size=16) | fields


# --------------------------------------------------------------------------------- presets
# state-spaces/mamba-130m-hf and mamba-2.8b-hf (transformers' conversions): tied embeddings, vocab 50280,
# inner 2 x hidden, dt rank hidden / 16, state 16; tiiuae/falcon-mamba-7b: 64 layers of 4096, inner 8192, rank 256
MAMBA = Family(
    "mamba", ("mamba",), "MambaForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        "mamba-130m": _mamba(24, 768, 1536, 48, vocab_size=50280, tie_word_embeddings=True, bos_token_id=0,
                             eos_token_id=0),
        "mamba-2.8b": _mamba(64, 2560, 5120, 160, vocab_size=50280, tie_word_embeddings=True, bos_token_id=0,
                             eos_token_id=0),
        "mamba-tiny": _mamba(2, 64, 128, 4, vocab_size=512, bos_token_id=None, eos_token_id=None),
    })
FALCON_MAMBA = Family(
    "falcon_mamba", ("falcon_mamba",), "FalconMambaForCausalLM", FALCON_SCHEMA, FEATURES | {"mamba1_bcdt_norm"},
    from_hf, to_hf, global_weights, layer_weights,
    presets={
        "falcon-mamba-7b": _mamba(64, 4096, 8192, 256, vocab_size=65024, tie_word_embeddings=False, bos_token_id=0,
                                  eos_token_id=11, mamba1_bcdt_rms_eps=1e-6),
        "falcon-mamba-tiny": _mamba(2, 64, 128, 4, vocab_size=512, bos_token_id=None, eos_token_id=None,
                                    mamba1_bcdt_rms_eps=1e-6),
    })
