"""Gemma 1, 2 and 3 (text): Llama's tensors, features switched on by generation.

Gemma: GeGLU (``gelu_pytorch_tanh``), RMSNorm scaled by (1 + weight), embeddings times
sqrt(hidden_size), a tied head, head_dim 256. Gemma 2 adds four norms a block
(``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``), soft-capped attention and final logits, ``query_pre_attn_scalar``
and alternating local (sliding window) and global layers. Gemma 3 (text, ``gemma3_text``) adds
qk-norm, 5 local : 1 global, and a rotary base of its own for local layers (unscaled; the
global layers' has ``rope_scaling``). HF's ``layer_types`` must be a pattern shardzoo expresses:
every p-th layer global, the rest local (``sliding_window_pattern`` = p).
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFError, Weight, mismatches, rope
from shardzoo.models.hf.llama import LAYER, rotary_fields, rotary_to_hf
from shardzoo.models.transformer import TransformerConfig

SLIDING, FULL = "sliding_attention", "full_attention"
# model_types that name a Gemma but that shardzoo does not read, and why (registry.py).
REFUSED = {"gemma3": "multimodal Gemma 3 (model_type 'gemma3', a vision tower with a text model) "
                     "is not supported; shardzoo reads the text-only gemma3_text"}
# config.json keys each family reads itself, not through llama.rotary_fields.
_OWN_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "layer_types", "sliding_window",
             "hidden_act", "hidden_activation")


# ------------------------------------------------------------------------------ config.json
def layer_types(period: int | None, n_layers: int, local: bool = True) -> list[str]:
    """HF's ``layer_types``: every ``period``-th layer full attention, the others sliding (no
    period: all sliding if ``local``, else all full)."""
    if period is None:
        return [SLIDING if local else FULL] * n_layers
    return [FULL if (i + 1) % period == 0 else SLIDING for i in range(n_layers)]


def _pattern(hf: dict, where: str, default_period: int) -> tuple[int | None, bool]:
    """(sliding_window_pattern, whether any layer is local) from ``layer_types`` or the older
    ``sliding_window_pattern``."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        types = layer_types(hf.get("sliding_window_pattern", default_period), n)
    types = list(types)
    if set(types) <= {FULL}:
        return None, False
    if set(types) <= {SLIDING}:
        return None, True
    for period in range(2, n + 1):
        if types == layer_types(period, n):
            return period, True
    raise HFError(f"{where}: layer_types {types} is not a pattern shardzoo expresses "
                  f"(every p-th layer {FULL}, the others {SLIDING})")


def _common(hf: dict, where: str, act: str) -> dict:
    if hf.get("use_bidirectional_attention"):
        raise HFError(f"{where}: use_bidirectional_attention=true is not supported (causal only)")
    fields = rotary_fields({k: v for k, v in hf.items() if k not in _OWN_KEYS}, where)
    bias = hf.get("attention_bias", False)  # one flag for q/k/v/o
    return fields | dict(
        hidden_act=act, norm_type="rmsnorm_plus_one", scale_embeddings=True,
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
        attention_bias=bias, attention_out_bias=bias,
    )


def gemma_from_hf(hf: dict, where: str) -> dict:
    act = hf.get("hidden_act") or "gelu_pytorch_tanh"
    act = "gelu_pytorch_tanh" if act == "gelu" else act  # as transformers' GemmaConfig reads it
    theta, scaling = rope(hf, where)
    return _common(hf, where, act) | dict(rope_theta=theta, rope_scaling=scaling)


def _gemma2_fields(hf: dict, where: str, default_period: int, caps: float | None) -> dict:
    """What Gemma 2 and 3 share: four norms a block, soft-caps, the scalar, the pattern."""
    period, local = _pattern(hf, where, default_period)
    fields = _common(hf, where, hf.get("hidden_activation") or "gelu_pytorch_tanh")
    return fields | dict(
        norm_position="both", query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        attn_logit_softcapping=hf.get("attn_logit_softcapping", 50.0 if caps else None),
        final_logit_softcapping=hf.get("final_logit_softcapping", 30.0 if caps else None),
        sliding_window=hf.get("sliding_window", 4096) if local else None,
        sliding_window_pattern=period,
    )


def gemma2_from_hf(hf: dict, where: str) -> dict:
    fields = _gemma2_fields(hf, where, 2, caps=True)
    if fields["sliding_window"] is None:  # local layers without a window: all alike
        fields["sliding_window_pattern"] = None
    theta, scaling = rope(hf, where)
    return fields | dict(rope_theta=theta, rope_scaling=scaling)


def _gemma3_rope(hf: dict, where: str) -> tuple[float, dict | None, float]:
    """(global theta, global scaling, local theta) from transformers 5's per-layer-type
    ``rope_parameters`` or the older ``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``."""
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        glob, loc = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        glob = dict(hf.get("rope_scaling") or {}) | dict(rope_theta=hf.get("rope_theta", 1e6))
        loc = dict(rope_theta=hf.get("rope_local_base_freq", 1e4))
    glob.setdefault("rope_theta", 1e6)
    loc.setdefault("rope_theta", 1e4)
    theta, scaling = rope(dict(rope_parameters=glob), where)
    local_theta, local_scaling = rope(dict(rope_parameters=loc), where)
    if local_scaling:
        raise HFError(f"{where}: rope scaling of the {SLIDING} layers "
                      f"({local_scaling['rope_type']}) is not supported; only the global layers'")
    return theta, scaling, local_theta


def gemma3_from_hf(hf: dict, where: str) -> dict:
    fields = _gemma2_fields(hf, where, 6, caps=False)
    theta, scaling, local_theta = _gemma3_rope(hf, where)
    if fields["sliding_window_pattern"] is None:  # all layers alike: all local or all global
        if fields["sliding_window"] is not None:
            theta, scaling = local_theta, None
        local_theta = None
    elif local_theta == theta and scaling is None:
        local_theta = None  # one rotary embedding: one spelling
    return fields | dict(qk_norm="head", rope_theta=theta, rope_scaling=scaling,
                         rope_local_base_freq=local_theta)


def gemma_to_hf(c) -> dict:
    out = rotary_to_hf(c) | dict(attention_bias=c.attention_bias)
    del out["sliding_window"]
    return out


def gemma2_to_hf(c) -> dict:
    out = rotary_to_hf(c)
    del out["hidden_act"]
    return out | dict(
        hidden_activation=c.hidden_act, attention_bias=c.attention_bias,
        query_pre_attn_scalar=c.query_pre_attn_scalar or c.head_size,
        attn_logit_softcapping=c.attn_logit_softcapping,
        final_logit_softcapping=c.final_logit_softcapping,
        layer_types=layer_types(c.sliding_window_pattern, c.num_hidden_layers,
                                local=c.sliding_window is not None),
    )


def gemma3_to_hf(c) -> dict:
    out = gemma2_to_hf(c)
    if c.sliding_window_pattern is None and c.sliding_window is not None:  # every layer local
        out.update(rope_scaling=None, rope_local_base_freq=c.rope_theta)
    else:
        out["rope_local_base_freq"] = c.rope_local_base_freq or c.rope_theta
    return out


def _obstacles(c, **features) -> list[str]:
    need = dict(position_embedding="rope", norm_type="rmsnorm_plus_one", mlp_type="gated",
                scale_embeddings=True, mlp_bias=False, partial_rotary_factor=1.0)
    bad = mismatches(c, need | features) + llama.one_attention_bias(c)
    if c.num_local_experts:
        bad.append(f"num_local_experts={c.num_local_experts}")
    return bad


def gemma_obstacles(c) -> list[str]:
    bad = _obstacles(c, norm_position="pre", qk_norm="none", attn_logit_softcapping=None,
                     final_logit_softcapping=None, sliding_window=None,
                     sliding_window_pattern=None, rope_local_base_freq=None)
    if c.query_pre_attn_scalar not in (None, c.head_size):
        bad.append(f"query_pre_attn_scalar={c.query_pre_attn_scalar!r}")
    return bad


def gemma2_obstacles(c) -> list[str]:
    return _obstacles(c, norm_position="both", qk_norm="none", rope_local_base_freq=None)


def gemma3_obstacles(c) -> list[str]:
    bad = _obstacles(c, norm_position="both", qk_norm="head")
    all_local = c.sliding_window_pattern is None and c.sliding_window is not None
    if c.rope_scaling and (all_local or c.sliding_window_pattern and not c.rope_local_base_freq):
        bad.append("rope_scaling on local layers (Gemma 3 scales the global layers' only)")
    return bad


# --------------------------------------------------------------------------------- weights
def weights(c):
    """(global, dense layer, MoE layer): Llama's tensors; with four norms a block (Gemma 2/3),
    input_layernorm and pre_feedforward_layernorm before, post_attention_layernorm and
    post_feedforward_layernorm after attention and the MLP."""
    glob, layer, _ = llama.weights(c)  # its norms: the pre-norms, or (not "pre") the post-norms
    if c.norm_position == "both":
        layer += [Weight(("attn_norm", "scale"), LAYER + "input_layernorm.weight"),
                  Weight(("mlp_norm", "scale"), LAYER + "pre_feedforward_layernorm.weight")]
    return glob, layer, []


GEMMA = Family("gemma", ("gemma",), "GemmaForCausalLM", TransformerConfig,
               gemma_from_hf, gemma_to_hf, gemma_obstacles, weights)
GEMMA2 = Family("gemma2", ("gemma2",), "Gemma2ForCausalLM", TransformerConfig,
                gemma2_from_hf, gemma2_to_hf, gemma2_obstacles, weights)
GEMMA3 = Family("gemma3_text", ("gemma3_text",), "Gemma3ForCausalLM", TransformerConfig,
                gemma3_from_hf, gemma3_to_hf, gemma3_obstacles, weights)
