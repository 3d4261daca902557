"""EXAONE 4: OLMo 2's post-norms (``post_attention_layernorm``, ``post_feedforward_layernorm``),
Qwen3's qk-norm of each head, sliding and full layers by ``layer_types`` (else every
``sliding_window_pattern``-th layer full), and no rotary embedding on the full layers of a
model with a window ("global NoPE"; without a window every layer rotates). No biases.
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig, layer_types

# Exaone4Config's fields and defaults (transformers 5)
SCHEMA = ({k: v for k, v in llama.SCHEMA.items()
           if k not in ("attention_bias", "mlp_bias", "pretraining_tp", "head_dim")}
          | dict(vocab_size=102400, intermediate_size=16384, num_key_value_heads=32, rms_norm_eps=1e-5,
                 bos_token_id=0, eos_token_id=2, sliding_window=4096, sliding_window_pattern=4,
                 layer_types=None))
FEATURES = (llama.ROTARY - {"pre_norms"}) | {"post_norms", "qk_norm_head", "sliding_window", "layer_pattern",
                                             "nope_layers"}


def _types(hf: HFConfig, window) -> tuple[str, ...]:
    """Each layer's kind: ``layer_types``, else (as transformers derives it) full every
    ``sliding_window_pattern``-th layer, all full without a window."""
    n, types = hf.get("num_hidden_layers"), hf.get("layer_types")
    pattern = hf.get("sliding_window_pattern")
    if types is not None:
        return tuple(types)
    if window is None:
        return (FULL,) * n
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise hf.refuse("sliding_window_pattern", "without layer_types only a period (an integer >= 1) "
                                                  "says which layers are full")
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))


def from_hf(hf: HFConfig) -> dict:
    window = hf.get("sliding_window")
    types = _types(hf, window)
    # transformers rotates every layer without a window, else only the sliding ones
    rotates = None if window is None else tuple(t != FULL for t in types)
    return llama.rotary_fields(hf) | dict(
        sliding_window=window, layer_types=types if window is not None else None, norm_position="post",
        qk_norm="head", rope_layers=rotates)


def _pattern(types: list[str]) -> int:
    """A ``sliding_window_pattern`` that gives ``types`` in whole periods (4, transformers' default,
    if none does; beside ``layer_types`` it is inert, so a part period is not guessed at)."""
    for p in range(1, len(types) + 1):
        if not len(types) % p and types == [SLIDING if (i + 1) % p else FULL for i in range(len(types))]:
            return p
    return 4


def to_hf(a) -> dict:
    types = layer_types(a)
    # head_dim too: Exaone4Config has no such field, but its attention reads one that config.json sets
    return llama.rotary_to_hf(a) | dict(sliding_window=a.sliding_window, layer_types=types,
                                        sliding_window_pattern=_pattern(types) if a.sliding_window else 0)


# sliding layers with full ones between them: the full ones without rotary embeddings
_TINY_TYPES = (SLIDING, FULL)
EXAONE4 = Family(
    "exaone4", ("exaone4",), "Exaone4ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, llama.layer_weights,  # post-norms and q_norm, k_norm (head_dim each)
    presets={"exaone4-tiny": llama.TINY | dict(
        norm_position="post", qk_norm="head", rms_norm_eps=1e-5, sliding_window=8, layer_types=_TINY_TYPES,
        rope_layers=tuple(t != FULL for t in _TINY_TYPES))})
