"""LFM2 (Liquid AI): gated short-convolution layers beside attention layers (``layer_types`` of
"conv" and "full_attention"; older configs give ``full_attn_idxs``). A conv layer's mixer is
the shared ``short_conv`` feature (``models/conv_mixer.py``); an attention layer is GQA with an
RMSNorm of each query and key head (``q_layernorm``, ``k_layernorm``) and rotary embeddings.
Every layer has pre-norms (``operator_norm``, ``ffn_norm``) and a SwiGLU MLP (``w1`` gate,
``w3`` up, ``w2`` down) whose width transformers derives from ``intermediate_size`` when
``block_auto_adjust_ff_dim``; the final norm is ``embedding_norm``. Export writes the width
itself (``block_auto_adjust_ff_dim: false``).
"""

from __future__ import annotations

from shardzoo.models.arch import CONV, FULL
from shardzoo.models.hf import llama
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    layer_types,
    rope,
    rope_to_hf,
    sizes,
    sizes_to_hf,
)

# Lfm2Config's fields and transformers' defaults
SCHEMA = dict(vocab_size=65536, hidden_size=2560, intermediate_size=12288, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=128000,
              initializer_range=0.02, norm_eps=1e-5, use_cache=True, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=True, rope_parameters=None, conv_bias=False,
              conv_L_cache=3, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
              block_auto_adjust_ff_dim=True, full_attn_idxs=None, layer_types=None)
FEATURES = llama.ROTARY | {"qk_norm_head", "layer_pattern", "short_conv", "conv_bias"}


def mlp_width(hf: HFConfig) -> int:
    """The SwiGLU width transformers' ``Lfm2MLP`` builds: 2/3 of ``intermediate_size`` (older
    configs: ``block_ff_dim``), times ``block_ffn_dim_multiplier``, rounded up to a multiple of
    ``block_multiple_of``, when ``block_auto_adjust_ff_dim``."""
    width = hf.raw.get("block_ff_dim", hf.get("intermediate_size"))
    if not hf.get("block_auto_adjust_ff_dim"):
        hf.ignore("block_ffn_dim_multiplier", "block_multiple_of")
        return width
    width = int(2 * width / 3)
    multiplier, multiple = hf.get("block_ffn_dim_multiplier"), hf.get("block_multiple_of")
    if multiplier is not None:
        width = int(multiplier * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def layer_fields(hf: HFConfig) -> dict:
    """Everything but the MLP's width: sizes, rotary, the conv and attention layers (LFM2-MoE
    reads them alike)."""
    hf.ignore(*INERT)
    out = sizes(hf, "norm_eps") | rope(hf, theta=1000000.0)
    out.pop("partial_rotary_factor")  # LFM2 rotates whole heads
    out.pop("hidden_act")  # always SiLU
    n = out["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:  # transformers derives them from full_attn_idxs (default: every layer attends)
        idxs = hf.get("full_attn_idxs")
        types = [FULL if i in (range(n) if idxs is None else idxs) else CONV for i in range(n)]
    else:
        hf.ignore("full_attn_idxs")  # transformers ignores it beside layer_types
    if any(t not in (FULL, CONV) for t in types):
        raise hf.refuse("layer_types", f"LFM2's layers are {FULL!r} or {CONV!r}")
    if "tie_embedding" in hf.raw:  # the older name, which transformers still reads
        out["tie_word_embeddings"] = hf.raw["tie_embedding"]
    return out | dict(qk_norm="head", layer_types=tuple(types), conv_kernel=hf.get("conv_L_cache"),
                      conv_bias=hf.get("conv_bias"))


def from_hf(hf: HFConfig) -> dict:
    return layer_fields(hf) | dict(intermediate_size=mlp_width(hf))


def to_hf(a) -> dict:
    out = sizes_to_hf(a) | rope_to_hf(a) | dict(
        norm_eps=a.rms_norm_eps, block_auto_adjust_ff_dim=False, layer_types=layer_types(a),
        conv_L_cache=a.conv.kernel if a.conv else SCHEMA["conv_L_cache"], conv_bias=bool(a.conv and a.conv.bias))
    for key in ("rms_norm_eps", "hidden_act", "partial_rotary_factor"):
        out.pop(key, None)
    if a.head_dim is None:
        del out["head_dim"]  # Lfm2Config has none: hidden_size / heads
    return out


# --------------------------------------------------------------------------------- weights
def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), "model.embed_tokens.weight"),
           Weight(("final_norm", "scale"), "model.embedding_norm.weight")]
    if not a.tie_word_embeddings:
        out.append(Weight(("lm_head", "kernel"), "lm_head.weight", "linear"))
    return out


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    out = [Weight(("attn_norm", "scale"), h + "operator_norm.weight"),
           Weight(("mlp_norm", "scale"), h + "ffn_norm.weight")]
    out += [Weight(("mlp", n, "kernel"), h + f"feed_forward.{w}.weight", "linear")
            for n, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))]
    if spec.mixer == CONV:
        c = h + "conv."
        for j, n in enumerate("bcx"):  # in_proj's rows: B, C, x
            out.append(Weight(("conv", f"in_{n}", "kernel"), c + "in_proj.weight", "linear", part=(j, 3)))
            if a.conv.bias:
                out.append(Weight(("conv", f"in_{n}", "bias"), c + "in_proj.bias", "vec", part=(j, 3)))
        out += [Weight(("conv", "kernel"), c + "conv.weight", "depthwise"),
                Weight(("conv", "out", "kernel"), c + "out_proj.weight", "linear")]
        if a.conv.bias:
            out += [Weight(("conv", "bias"), c + "conv.bias", "vec"),
                    Weight(("conv", "out", "bias"), c + "out_proj.bias", "vec")]
        return out
    s = h + "self_attn."
    out += [Weight(("attn", n, "kernel"), s + f"{n}_proj.weight", "linear") for n in "qkv"]
    out += [Weight(("attn", "o", "kernel"), s + "out_proj.weight", "linear", n_in=2),
            Weight(("attn", "q_norm", "scale"), s + "q_layernorm.weight"),
            Weight(("attn", "k_norm", "scale"), s + "k_layernorm.weight")]
    return out


# --------------------------------------------------------------------------------- presets
# LiquidAI/LFM2-1.2B/config.json: block_ff_dim 12288 auto-adjusted to 8192, attention on
# layers 2, 5, 8, 10, 12, 14 (full_attn_idxs), the rest conv layers
_ATTN = (2, 5, 8, 10, 12, 14)
LFM2_1_2B = dict(vocab_size=65536, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=128000,
                 rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=1,
                 eos_token_id=7, qk_norm="head", conv_kernel=3,
                 layer_types=tuple(FULL if i in _ATTN else CONV for i in range(16)))
LFM2 = Family(
    "lfm2", ("lfm2",), "Lfm2ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        "lfm2-1.2b": LFM2_1_2B,
        "lfm2-tiny": llama.TINY | dict(num_hidden_layers=4, qk_norm="head", conv_kernel=3, tie_word_embeddings=True,
                                       rope_theta=1000000.0, layer_types=(CONV, FULL, CONV, FULL)),
    })
