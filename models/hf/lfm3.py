"""LFM3 (Liquid AI, ``lfm3``): LFM2's gated short-convolution layers beside Qwen3's attention
(qk-norm, one bias flag) on sliding and full layers, each head's output times the sigmoid of its
own gate projected from the layer's input (``use_attention_gate``: ``attn_head_gate``); norms
after the mixer and the MLP too (``use_sandwich_norm``); a SwiGLU MLP ``intermediate_size`` wide
(``w1`` gate, ``w3`` up, ``w2`` down). Its rotary is per layer kind: the sliding layers' plain
(their base: ``rope_local_base_freq``), the full layers' proportional (Gemma 4's: the first
``partial_rotary_factor`` of each head's angles turn, over the whole head's width).
On disk the gate is ``self_attn.gate_proj`` (transformers' ``g_proj``).
"""

from __future__ import annotations

from shardzoo.models.arch import CONV, FULL, SLIDING
from shardzoo.models.hf import lfm2, llama, mellum
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, layer_types, sizes, sizes_to_hf

DEFAULT_ROPE = {SLIDING: dict(rope_type="default", rope_theta=10000.0),
                FULL: dict(rope_type="proportional", rope_theta=1000000.0, partial_rotary_factor=0.5)}
# Lfm3Config's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=128000, hidden_size=2048, intermediate_size=7680, num_hidden_layers=24, num_attention_heads=16,
              num_key_value_heads=4, max_position_embeddings=128000, initializer_range=0.02, norm_eps=1e-5,
              use_cache=True, pad_token_id=124893, bos_token_id=124894, eos_token_id=124900, tie_word_embeddings=True,
              rope_parameters=None, conv_bias=False, conv_L_cache=7, head_dim=128, sliding_window=256,
              use_sandwich_norm=True, use_attention_gate=True, attention_bias=False, attention_dropout=0.0,
              layer_types=None)
FEATURES = (llama.ROTARY - {"pre_norms"}) | {
    "pre_norms", "sandwich_norms", "qk_norm_head", "attention_bias", "attention_out_bias", "layer_pattern",
    "sliding_window", "local_rope", "rope_scaling:proportional", "short_conv", "conv_bias", "attention_head_gate"}


def _default_types(n: int) -> list[str]:
    """Lfm3Config's pattern: layer i full where i % 4 == 2, sliding where i % 4 == 0 (but 0), else conv."""
    return [FULL if i % 4 == 2 else SLIDING if i % 4 == 0 and i > 0 else CONV for i in range(n)]


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    out = sizes(hf, "norm_eps") | mellum.per_kind_rope(hf, DEFAULT_ROPE)
    out.pop("hidden_act")  # always SiLU
    types = tuple(hf.get("layer_types") or _default_types(out["num_hidden_layers"]))
    if any(t not in (FULL, SLIDING, CONV) for t in types):
        raise hf.refuse("layer_types", f"LFM3's layers are {CONV!r}, {SLIDING!r} or {FULL!r}")
    window = hf.get("sliding_window")
    bias = hf.get("attention_bias")
    return out | dict(
        qk_norm="head", attention_bias=bias, attention_out_bias=bias, layer_types=types,
        sliding_window=window if SLIDING in types else None, conv_kernel=hf.get("conv_L_cache"),
        conv_bias=hf.get("conv_bias"), norm_position="both" if hf.get("use_sandwich_norm") else "pre",
        attn_head_gate=bool(hf.get("use_attention_gate")))


def to_hf(a) -> dict:
    out = sizes_to_hf(a) | dict(
        norm_eps=a.rms_norm_eps, rope_parameters=mellum.per_kind_rope_to_hf(a, DEFAULT_ROPE),
        layer_types=layer_types(a), sliding_window=a.sliding_window, attention_bias=a.attention_bias,
        conv_L_cache=a.conv.kernel if a.conv else SCHEMA["conv_L_cache"], conv_bias=bool(a.conv and a.conv.bias),
        use_sandwich_norm=a.norm_position == "both", use_attention_gate=a.attn_head_gate,
        pad_token_id=None)  # an import's own survives the export; transformers' 124893 need not fit the vocabulary
    for key in ("rms_norm_eps", "hidden_act"):
        del out[key]
    return out


def layer_weights(a, spec) -> list[Weight]:
    """LFM2's norms, MLP and conv; the norms after mixer and MLP; Qwen3's attention and its gate."""
    h = llama.LAYER
    out = lfm2.layer_weights(a, spec)
    if a.norm_position == "both":
        out += [Weight(("post_attn_norm", "scale"), h + "post_operator_norm.weight"),
                Weight(("post_mlp_norm", "scale"), h + "post_ffn_norm.weight")]
    if spec.mixer == CONV:
        return out
    out = [w for w in out if w.path[0] != "attn"] + [w for w in llama.attention_weights(a) if w.path[0] == "attn"]
    if a.attn_head_gate:
        out.append(Weight(("attn", "head_gate", "kernel"), h + "self_attn.gate_proj.weight", "linear"))
    return out


LFM3 = Family(
    "lfm3", ("lfm3",), "Lfm3ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, lfm2.global_weights, layer_weights,
    presets={
        # conv, sliding (a window of 8, its own base), full (proportional rotary on half the angles) layers
        "lfm3-tiny": llama.TINY | dict(
            num_hidden_layers=3, head_dim=16, tie_word_embeddings=True, qk_norm="head", norm_position="both",
            attn_head_gate=True, conv_kernel=7, layer_types=(CONV, SLIDING, FULL), sliding_window=8,
            rope_theta=1000000.0, rope_local_base_freq=10000.0,
            rope_scaling=dict(rope_type="proportional", partial_rotary_factor=0.5)),
    })
