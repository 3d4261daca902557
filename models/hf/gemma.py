"""Gemma 1, 2 and 3 (text): Llama's tensors, features switched on by generation.

Gemma: GeGLU (``gelu_pytorch_tanh``), RMSNorm scaled by (1 + weight), embeddings times
sqrt(hidden_size), a tied head, head_dim 256. Gemma 2 adds four norms a block
(``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``), soft-capped attention and final logits, ``query_pre_attn_scalar``
and alternating local (sliding window) and global layers. Gemma 3 (text, ``gemma3_text``) adds
qk-norm, 5 local : 1 global, and a rotary base of its own for local layers (unscaled; the
global layers' has ``rope_scaling``). ``layer_types`` may be any pattern.
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig, HFError, Weight, layer_types, rope

SCHEMA = ({k: v for k, v in llama.SCHEMA.items() if k not in ("mlp_bias", "pretraining_tp")}
          | dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                 num_attention_heads=16, head_dim=256, hidden_act="gelu_pytorch_tanh",
                 max_position_embeddings=8192, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                 tie_word_embeddings=True, use_bidirectional_attention=None))
SCHEMA2 = ({k: v for k, v in SCHEMA.items() if k != "hidden_act"}
           | dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                  num_key_value_heads=4, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                  attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
                  layer_types=None))
SCHEMA3 = (SCHEMA2 | dict(vocab_size=262208, max_position_embeddings=131072, attn_logit_softcapping=None,
                          final_logit_softcapping=None, use_bidirectional_attention=False,
                          _sliding_window_pattern=6))
FEATURES = (llama.ROTARY - {"rmsnorm"}) | {"rmsnorm_plus_one", "scale_embeddings", "attention_bias",
                                           "attention_out_bias"}
FEATURES2 = ((FEATURES - {"pre_norms"}) | {"sandwich_norms", "query_pre_attn_scalar", "attention_softcap",
                                           "final_softcap", "sliding_window", "layer_pattern"})
FEATURES3 = FEATURES2 | {"qk_norm_head", "local_rope"}


# ------------------------------------------------------------------------------ config.json
def _common(hf: HFConfig, act: str) -> dict:
    bias = hf.get("attention_bias")  # one flag for q/k/v/o
    fields = llama.rotary_fields(hf)
    return fields | dict(hidden_act=act, norm_type="rmsnorm_plus_one", scale_embeddings=True,
                         attention_bias=bias, attention_out_bias=bias)


def gemma_from_hf(hf: HFConfig) -> dict:
    act = hf.get("hidden_act") or "gelu_pytorch_tanh"
    hf.ignore("hidden_activation")
    return _common(hf, "gelu_pytorch_tanh" if act == "gelu" else act)  # as transformers' GemmaConfig


def _pattern(hf: HFConfig, default_period: int) -> dict:
    """``layer_types`` (HF's, or every ``sliding_window_pattern``-th layer global) and the window."""
    n = hf.get("num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:
        period = hf.get("sliding_window_pattern", None) or hf.get("_sliding_window_pattern", default_period)
        types = [FULL if (i + 1) % period == 0 else SLIDING for i in range(n)]
    hf.ignore("sliding_window_pattern", "_sliding_window_pattern")
    window = hf.get("sliding_window")
    if window is None or SLIDING not in types:
        return dict(sliding_window=None, layer_types=None)
    return dict(sliding_window=window, layer_types=tuple(types))


def _gemma2_fields(hf: HFConfig, default_period: int) -> dict:
    """What Gemma 2 and 3 share: four norms a block, soft-caps, the scalar, the pattern."""
    return _common(hf, hf.get("hidden_activation") or "gelu_pytorch_tanh") | _pattern(hf, default_period) | dict(
        norm_position="both", query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
        attn_logit_softcapping=hf.get("attn_logit_softcapping"),
        final_logit_softcapping=hf.get("final_logit_softcapping"))


def gemma2_from_hf(hf: HFConfig) -> dict:
    return _gemma2_fields(hf, 2)


def gemma3_from_hf(hf: HFConfig) -> dict:
    """Gemma 3's two rotary embeddings: transformers 5's ``rope_parameters`` per layer kind, or
    the older ``rope_theta``, ``rope_scaling`` and ``rope_local_base_freq``."""
    fields = _gemma2_fields(hf, 6)
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        glob = dict(params.get(FULL) or {})
        loc = dict(params.get(SLIDING) or {})
        glob, local = rope(hf, glob, theta=1e6), rope(hf, loc, theta=1e4)
        if local["rope_scaling"]:
            raise HFError(f"{hf.where}: rope scaling of the {SLIDING} layers "
                          f"({local['rope_scaling']['rope_type']}) is not supported; only the global layers'")
        local_theta = local["rope_theta"]
    else:
        glob = rope(hf, theta=1e6)
        local_theta = hf.get("rope_local_base_freq", 1e4)
    return fields | dict(qk_norm="head", rope_theta=glob["rope_theta"], rope_scaling=glob["rope_scaling"],
                         rope_local_base_freq=local_theta)


def gemma_to_hf(a) -> dict:
    return llama.rotary_to_hf(a) | dict(attention_bias=a.attention_bias)


def gemma2_to_hf(a) -> dict:
    out = llama.rotary_to_hf(a)
    del out["hidden_act"]
    return out | dict(
        hidden_activation=a.hidden_act, attention_bias=a.attention_bias,
        query_pre_attn_scalar=a.query_pre_attn_scalar or a.head_size,
        attn_logit_softcapping=a.attn_logit_softcapping, final_logit_softcapping=a.final_logit_softcapping,
        sliding_window=a.sliding_window, layer_types=layer_types(a))


def gemma3_to_hf(a) -> dict:
    return gemma2_to_hf(a) | dict(rope_local_base_freq=a.rope_local_base_freq or a.rope_theta)


# --------------------------------------------------------------------------------- weights
def layer_weights(a, spec) -> list[Weight]:
    """Llama's tensors; with four norms a block (Gemma 2/3), input_layernorm and
    pre_feedforward_layernorm before, post_attention_layernorm and post_feedforward_layernorm
    after attention and the MLP."""
    layer = llama.layer_weights(a, spec)  # its norms: the pre-norms, or (not "pre") the post-norms
    if a.norm_position == "both":
        layer += [Weight(("attn_norm", "scale"), llama.LAYER + "input_layernorm.weight"),
                  Weight(("mlp_norm", "scale"), llama.LAYER + "pre_feedforward_layernorm.weight")]
    return layer


# --------------------------------------------------------------------------------- presets
# google/gemma-2b, gemma-2-*, gemma-3-*-pt config.json
BASE = dict(vocab_size=256000, head_dim=256, max_position_embeddings=8192, hidden_act="gelu_pytorch_tanh",
            norm_type="rmsnorm_plus_one", scale_embeddings=True, tie_word_embeddings=True,
            bos_token_id=2, eos_token_id=1)


def _every(p: int, n: int) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % p == 0 else SLIDING for i in range(n))


def _gemma2(n: int, **kw) -> dict:
    return BASE | dict(norm_position="both", query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, sliding_window=4096, layer_types=_every(2, n),
                       num_hidden_layers=n) | kw


def _gemma3(n: int, **kw) -> dict:
    return BASE | dict(vocab_size=262144, norm_position="both", qk_norm="head", query_pre_attn_scalar=256,
                       rope_theta=1000000.0, rope_local_base_freq=10000.0, num_hidden_layers=n,
                       layer_types=_every(6, n)) | kw


_TINY = llama.TINY | dict(bos_token_id=None, eos_token_id=None)
GEMMA = Family(
    "gemma", ("gemma",), "GemmaForCausalLM", SCHEMA, FEATURES, gemma_from_hf, gemma_to_hf,
    llama.global_weights, layer_weights,
    presets={
        "gemma-2b": BASE | dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                                num_attention_heads=8, num_key_value_heads=1),
        "gemma-tiny": BASE | _TINY | dict(num_key_value_heads=1, head_dim=32),
    })
GEMMA2 = Family(
    "gemma2", ("gemma2",), "Gemma2ForCausalLM", SCHEMA2, FEATURES2, gemma2_from_hf, gemma2_to_hf,
    llama.global_weights, layer_weights,
    presets={
        "gemma-2-2b": _gemma2(26, hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
                              num_key_value_heads=4),
        "gemma-2-9b": _gemma2(42, hidden_size=3584, intermediate_size=14336, num_attention_heads=16,
                              num_key_value_heads=8),
        # windows shorter than a test's sequence, caps that clip
        "gemma2-tiny": _gemma2(4, **(_TINY | dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16,
                                                  sliding_window=8, attn_logit_softcapping=2.0,
                                                  final_logit_softcapping=2.0))),
    })
GEMMA3 = Family(
    "gemma3_text", ("gemma3_text",), "Gemma3ForCausalLM", SCHEMA3, FEATURES3, gemma3_from_hf, gemma3_to_hf,
    llama.global_weights, layer_weights,
    presets={
        "gemma-3-1b": _gemma3(26, hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
                              num_key_value_heads=1, sliding_window=512, max_position_embeddings=32768),
        "gemma-3-4b": _gemma3(34, vocab_size=262208, hidden_size=2560, intermediate_size=10240,  # text model
                              num_attention_heads=8, num_key_value_heads=4, sliding_window=1024,
                              max_position_embeddings=131072, rope_scaling={"rope_type": "linear", "factor": 8.0}),
        # 8 layers at period 6 (one period scanned... as the layout decides), a window shorter than the text
        "gemma3-tiny": _gemma3(8, **(_TINY | dict(num_hidden_layers=8, head_dim=16, query_pre_attn_scalar=16,
                                                  sliding_window=8,
                                                  rope_scaling={"rope_type": "linear", "factor": 8.0}))),
    })
