"""Falcon-H1 (TII): every layer runs GQA attention with rotary embeddings and a Mamba2 mixer side by
side on one RMSNorm (``input_layernorm``), their outputs summed into the residual (the layer kind
"attention+mamba"), then ``pre_ff_layernorm`` and a SwiGLU MLP. The mixer is the shared ``mamba2``
feature (``models/ssm.py``), its inner width ``mamba_d_ssm`` (else ``mamba_expand`` x hidden_size),
its output gated and RMSNorm'd (``mamba_rms_norm``, ``mamba_norm_before_gate``: ``mamba_norm``).

muP multipliers (``mup_multipliers``): ``embedding_multiplier`` (Granite's field), the logits times
``lm_head_multiplier`` (``logit_scale``, Cohere's), ``key_multiplier`` on the k projection's output,
``attention_in_multiplier`` / ``attention_out_multiplier`` and ``ssm_in_multiplier`` /
``ssm_out_multiplier`` around each mixer, ``ssm_multipliers`` on in_proj's z, x, B, C and dt
(transformers' ``mup_vector``), ``mlp_multipliers`` on the gate projection and the MLP's output.
"""

from __future__ import annotations

import math

from shardzoo.models.arch import ATTENTION_MAMBA
from shardzoo.models.hf import bamba, llama, mamba2
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, rope, rope_to_hf, sizes
from shardzoo.models.layers import Multipliers

# FalconH1Config's fields and transformers' defaults; and head_dim, which its attention and
# rotary embedding read when config.json has it (else hidden_size / num_attention_heads), and
# mamba_use_mlp, which the published configs set true (transformers always builds the MLP: false
# is refused rather than read as a model without one)
SCHEMA = dict(vocab_size=128000, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
              initializer_range=0.02, rms_norm_eps=1e-5, use_cache=True, num_logits_to_keep=1, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, max_position_embeddings=8192, attention_dropout=0.0, mamba_d_ssm=1024,
              mamba_n_heads=128, mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4,
              mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
              mamba_norm_before_gate=True, mamba_rms_norm=False, time_step_limit=[0.0, math.inf],
              projectors_bias=False, rope_parameters=None, lm_head_multiplier=1.0, embedding_multiplier=1.0,
              mlp_multipliers=None, key_multiplier=1.0, attention_out_multiplier=1.0, attention_in_multiplier=1.0,
              ssm_multipliers=None, ssm_in_multiplier=1.0, ssm_out_multiplier=1.0, attention_bias=False,
              mlp_bias=False, head_dim=None, mamba_use_mlp=True)
FEATURES = llama.ROTARY | {"layer_pattern", "mamba2", "mamba_proj_bias", "time_step_limit", "attention_bias",
                           "attention_out_bias", "mlp_bias", "multipliers", "logit_scale", "mup_multipliers",
                           "mamba_norm_before_gate", "mamba_no_norm"}
NAMES = dict(heads="mamba_n_heads", head_dim="mamba_d_head", groups="mamba_n_groups", state="mamba_d_state",
             conv="mamba_d_conv", chunk="mamba_chunk_size", conv_bias="mamba_conv_bias", proj_bias="mamba_proj_bias",
             expand="mamba_expand", act="hidden_act", limit="time_step_limit", inner="mamba_d_ssm")
SCALARS = ("key_multiplier", "attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier",
           "ssm_out_multiplier", "embedding_multiplier")


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "num_logits_to_keep")
    out = sizes(hf) | rope(hf) | mamba2.mamba_fields(hf, NAMES)
    if hf.get("projectors_bias") != out["mamba_proj_bias"]:
        raise hf.refuse("projectors_bias", f"the mamba out_proj's bias must be as in_proj's (mamba_proj_bias="
                                           f"{out['mamba_proj_bias']!r}) in shardzoo's falcon_h1")
    before = hf.get("mamba_norm_before_gate")  # without the norm (mamba_rms_norm false) it means nothing
    norm = ("before_gate" if before else "gated") if hf.get("mamba_rms_norm") else "none"
    bias = hf.get("attention_bias")
    multipliers = {}
    for key, n in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
        value = hf.get(key)
        if value is None:
            value = [1.0] * n
        if not isinstance(value, list) or len(value) != n:
            raise hf.refuse(key, f"must be a list of {n} numbers")
        multipliers[key] = tuple(value)
    return out | multipliers | {k: hf.get(k) for k in SCALARS} | dict(
        layer_types=(ATTENTION_MAMBA,) * out["num_hidden_layers"], attention_bias=bias, attention_out_bias=bias,
        mlp_bias=hf.get("mlp_bias"), mamba_norm=norm, logit_scale=hf.get("lm_head_multiplier"))


def to_hf(a) -> dict:
    names = dict(NAMES, expand=None)  # the inner width as mamba_d_ssm
    m = (a.multipliers or Multipliers()).flat()
    return mamba2.mamba_to_hf(a, names) | rope_to_hf(a) | {k: m.get(k, getattr(a, k, None)) for k in SCALARS} | dict(
        hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, num_hidden_layers=a.num_hidden_layers,
        num_attention_heads=a.num_attention_heads, num_key_value_heads=a.kv_heads, head_dim=a.head_size,
        max_position_embeddings=a.max_position_embeddings, rms_norm_eps=a.rms_norm_eps, hidden_act=a.hidden_act,
        attention_bias=a.attention_bias, mlp_bias=a.mlp_bias, mamba_d_ssm=a.mamba.inner,
        projectors_bias=a.mamba.proj_bias, mamba_rms_norm=a.mamba.norm != "none",
        mamba_norm_before_gate=a.mamba.norm != "gated", lm_head_multiplier=a.logit_scale,  # none: the default
        ssm_multipliers=list(m["ssm_multipliers"]), mlp_multipliers=list(m["mlp_multipliers"]))


global_weights = bamba.global_weights  # embed_tokens, final_layernorm, lm_head: Bamba's names


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    out = [Weight(("attn_norm", "scale"), h + "input_layernorm.weight"),
           Weight(("mlp_norm", "scale"), h + "pre_ff_layernorm.weight")] + llama.mlp_weights(a, "feed_forward.")
    attention = [w for w in llama.attention_weights(a) if w.path[0] == "attn"]
    return out + attention + mamba2.mamba_weights(a, h + "mamba.")


def _falcon_h1(n: int, **fields) -> dict:
    return dict(num_hidden_layers=n, layer_types=(ATTENTION_MAMBA,) * n, rms_norm_eps=1e-5) | fields


# --------------------------------------------------------------------------------- presets
FALCON_H1 = Family(
    "falcon_h1", ("falcon_h1",), "FalconH1ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights,
    layer_weights,
    presets={
        # tiiuae/Falcon-H1-0.5B-Base/config.json: 36 layers of width 1024, 8 attention heads of 64 (2 kv),
        # 24 mamba heads of 64 (mamba_d_ssm 1536) in one group, state 128, no gated norm (mamba_rms_norm false)
        "falcon-h1-0.5b": _falcon_h1(
            36, vocab_size=32784, hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=16384, rope_theta=1e11,
            mamba_num_heads=24, mamba_head_dim=64, mamba_n_groups=1, ssm_state_size=128, mamba_conv_kernel=4,
            mamba_chunk_size=128, mamba_norm="none", embedding_multiplier=5.656854249492381,
            logit_scale=0.0390625, key_multiplier=0.39062499999999994, attention_out_multiplier=0.9375,
            ssm_in_multiplier=1.25, ssm_out_multiplier=0.23570226039551587,
            ssm_multipliers=(0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738),
            mlp_multipliers=(0.8838834764831844, 0.5859375)),
        "falcon-h1-tiny": llama.TINY | _falcon_h1(
            2, mamba_num_heads=8, mamba_head_dim=16, mamba_n_groups=2, ssm_state_size=16, mamba_chunk_size=64,
            mamba_norm="gated", embedding_multiplier=2.0, logit_scale=0.25, key_multiplier=0.5,
            ssm_multipliers=(0.5, 1.0, 0.5, 1.0, 1.0), mlp_multipliers=(1.0, 0.5)),
    })
