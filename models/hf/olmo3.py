"""OLMo 3: OLMo 2's layout (norms on the outputs, qk-norm over the whole q and k projections)
with sliding-window and full-attention layers by ``layer_types`` (transformers' default: every
4th layer full). Its rotary embedding is given per layer kind (``rope_parameters``
``{full_attention: ..., sliding_attention: ...}``); rope scaling applies to the full layers
only, so the sliding layers rotate by their own, unscaled base (``rope_local_base_freq``)."""

from __future__ import annotations

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.hf import llama, olmo2
from shardzoo.models.hf.base import Family, HFConfig, HFError, layer_types, rope

THETA = 500000.0  # Olmo3Config's default base, of both layer kinds
SCHEMA = olmo2.SCHEMA | dict(sliding_window=4096, layer_types=None)
FEATURES = olmo2.FEATURES | {"sliding_window", "layer_pattern", "local_rope"}


def _every_4th_full(n: int) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % 4 == 0 else SLIDING for i in range(n))


def _rope(hf: HFConfig) -> dict:
    """The full layers' base and scaling, the sliding layers' base: transformers 5's
    ``rope_parameters`` per layer kind, or the older ``rope_theta`` and ``rope_scaling`` (the
    scaling on the full layers only, as ``Olmo3Config`` reads them)."""
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full = rope(hf, params.get(FULL) or {}, theta=THETA)
        local = rope(hf, params.get(SLIDING) or {}, theta=THETA)
        if local["rope_scaling"]:
            raise HFError(f"{hf.where}: rope scaling of the {SLIDING} layers "
                          f"({local['rope_scaling']['rope_type']}) is not supported; only the full layers'")
    else:
        full = rope(hf, theta=THETA)
        local = dict(rope_theta=full["rope_theta"])
    return dict(rope_theta=full["rope_theta"], rope_scaling=full["rope_scaling"],
                rope_local_base_freq=local["rope_theta"])


def from_hf(hf: HFConfig) -> dict:
    types = hf.get("layer_types") or _every_4th_full(hf.get("num_hidden_layers"))
    window = hf.get("sliding_window")
    pattern = (dict(sliding_window=window, layer_types=tuple(types)) if window and SLIDING in types
               else dict(sliding_window=None, layer_types=None))
    return olmo2.from_hf(hf) | _rope(hf) | pattern


def to_hf(a) -> dict:
    out = llama.rotary_to_hf(a)
    del out["rope_theta"]
    full = dict(out.pop("rope_scaling") or dict(rope_type="default"), rope_theta=a.rope_theta)
    local = dict(rope_type="default", rope_theta=a.rope_local_base_freq or a.rope_theta)
    return out | dict(attention_bias=a.attention_bias, rope_parameters={FULL: full, SLIDING: local},
                      sliding_window=a.sliding_window, layer_types=layer_types(a))


# Olmo3Config's defaults (transformers 5.25: the 7B shape); allenai/Olmo-3-1025-7B's own
# config.json was not at hand, so its vocabulary, context and rope scaling may differ.
BASE = dict(vocab_size=50304, rope_theta=THETA, norm_position="post", qk_norm="projection",
            rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=50279, sliding_window=4096)
OLMO3 = Family(
    "olmo3", ("olmo3",), "Olmo3ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, llama.layer_weights,
    presets={
        "olmo-3-7b": BASE | dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                 num_attention_heads=32, max_position_embeddings=2048,
                                 layer_types=_every_4th_full(32)),
        # a window shorter than a test's text; 3 sliding : 1 full
        "olmo3-tiny": BASE | llama.TINY | dict(num_hidden_layers=4, sliding_window=8,
                                               layer_types=_every_4th_full(4)),
    })
