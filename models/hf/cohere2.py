"""Cohere 2 (Command R7B): Cohere's layer (attention and MLP side by side from one LayerNorm
without bias, a gated SwiGLU MLP, rotary embeddings on interleaved pairs, tied embeddings,
logits times ``logit_scale``) with sliding and full layers by ``layer_types`` (else every
``sliding_window_pattern``-th layer full), and rotary embeddings on the sliding layers only:
the full layers have no positions (NoPE): transformers rotates exactly the layers it gives a
window. No qk-norm. A ``sliding_window`` of null is refused (transformers' Cohere 2 builds the
sliding layers' mask whatever the layers are, and fails without one).
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.hf import cohere, llama
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    layer_types,
    rope,
    rope_to_hf,
    sizes,
    sizes_to_hf,
)

# Cohere2Config's fields and defaults (transformers 5), and sliding_window_pattern, which it
# reads (4 when absent) to derive layer_types when config.json has none (the published one).
SCHEMA = dict(vocab_size=256000, hidden_size=8192, intermediate_size=22528, logit_scale=0.0625,
              num_hidden_layers=40, num_attention_heads=64, num_key_value_heads=None, hidden_act="silu",
              max_position_embeddings=8192, initializer_range=0.02, layer_norm_eps=1e-5, use_cache=True,
              pad_token_id=0, bos_token_id=5, eos_token_id=255001, tie_word_embeddings=True,
              rope_parameters=None, attention_bias=False, attention_dropout=0.0, sliding_window=4096,
              layer_types=None, sliding_window_pattern=4)
FEATURES = frozenset({"rope", "rope_scaling:linear", "rope_scaling:llama3", "rope_interleaved",
                      "layernorm_no_bias", "pre_norms", "parallel_residual", "gated_mlp", "attention_bias",
                      "attention_out_bias", "logit_scale", "sliding_window", "layer_pattern", "nope_layers"})


def _types(hf: HFConfig) -> tuple[str, ...]:
    """Each layer's kind: ``layer_types``, else sliding but every ``sliding_window_pattern``-th."""
    types = hf.get("layer_types")
    if types is not None:
        return tuple(types)
    pattern = hf.get("sliding_window_pattern")
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise hf.refuse("sliding_window_pattern", "without layer_types only a period (an integer >= 1) "
                                                  "says which layers are full")
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(hf.get("num_hidden_layers")))


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    window, types = hf.get("sliding_window"), _types(hf)
    if window is None:
        raise hf.refuse("sliding_window", "transformers' Cohere 2 needs a window (it builds the sliding "
                                          "layers' mask for every model)")
    bias = hf.get("attention_bias")  # q/k/v and o
    out = sizes(hf, "layer_norm_eps") | rope(hf) | dict(
        head_dim=None,  # Cohere2Config sets hidden_size / heads, whatever config.json says
        norm_type="layernorm_no_bias", block_form="parallel", rope_interleaved=True,
        attention_bias=bias, attention_out_bias=bias, logit_scale=hf.get("logit_scale"),
        sliding_window=window, layer_types=types, rope_layers=tuple(t == SLIDING for t in types))
    out.pop("partial_rotary_factor")  # Cohere 2 rotates whole heads
    return out


def to_hf(a) -> dict:
    out = sizes_to_hf(a) | rope_to_hf(a) | dict(
        layer_norm_eps=a.rms_norm_eps, logit_scale=a.logit_scale, attention_bias=a.attention_bias,
        sliding_window=a.sliding_window or SCHEMA["sliding_window"],  # one no layer uses, if none slides
        layer_types=layer_types(a))
    for key in ("rms_norm_eps", "head_dim", "partial_rotary_factor"):
        out.pop(key, None)  # head_dim: Cohere2Config derives it (hidden_size / heads)
    return out


# CohereForAI/c4ai-command-r7b-12-2024/config.json as published (layer_types from
# sliding_window_pattern 4: three sliding layers with rotary embeddings, then a full NoPE one)
_R7B_TYPES = tuple(SLIDING if (i + 1) % 4 else FULL for i in range(32))
COMMAND_R7B = cohere.BASE | dict(
    vocab_size=256000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=132096, rope_theta=50000.0, logit_scale=0.25,
    bos_token_id=5, eos_token_id=255001, sliding_window=4096, layer_types=_R7B_TYPES,
    rope_layers=tuple(t == SLIDING for t in _R7B_TYPES))
# sliding, sliding, full (NoPE), sliding: a window shorter than a test's text
_TINY_TYPES = (SLIDING, SLIDING, FULL, SLIDING)
COHERE2 = Family(
    "cohere2", ("cohere2",), "Cohere2ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, cohere.layer_weights,
    presets={"command-r7b": COMMAND_R7B,
             "cohere2-tiny": cohere.BASE | llama.TINY | dict(
                 num_hidden_layers=4, sliding_window=8, layer_types=_TINY_TYPES,
                 rope_layers=tuple(t == SLIDING for t in _TINY_TYPES))})
