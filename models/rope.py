"""Rotary position embeddings: inverse frequencies as transformers computes them (every
``rope_scaling`` type of ``ROPE_SCALING``), the rotation, and the decoding check of longrope.
Attention (``models/attention.py``) and latent attention rotate their queries and keys with it.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from shardzoo.models import ModelError
from shardzoo.models.layers import positive

# rope_scaling types this module computes, with the keys each needs (a number > 0) and
# the numbers each may have (> 0, or null: transformers' default).
ROPE_SCALING = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "dynamic": ("factor",),
    "proportional": (),
}
ROPE_SCALING_OPTIONAL = {
    "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"),
    "longrope": ("factor", "attention_factor"),
    "proportional": ("partial_rotary_factor", "factor"),
}


def _scaling(config, local: bool) -> dict:
    """The layer's ``rope_scaling`` (none for a local layer with its own base: Gemma 3)."""
    return {} if local and config.rope_local_base_freq else config.rope_scaling_dict


def rope_inv_freq(config, local: bool = False, long: bool = False) -> np.ndarray:
    """Inverse frequencies of the rotary embedding, float32, as Hugging Face computes them.

    Handles ``partial_rotary_factor`` (latent attention: ``qk_rope_head_dim``) and every ``rope_scaling`` type of ``arch.ROPE_SCALING``,
    each as ``transformers.modeling_rope_utils`` computes it at initialisation: linear, llama3,
    yarn, longrope (its ``short_factor``; ``long``: its ``long_factor``), dynamic (plain
    within ``max_position_embeddings``; beyond, ``rope_frequencies`` rescales per call) and
    proportional (Gemma 4's global layers: the first ``partial_rotary_factor`` of the head's pairs
    turn at the frequencies of the whole head's width, the others not at all; ``/ factor``).
    A ``local`` layer with ``rope_local_base_freq`` set uses that base, unscaled (Gemma 3).
    ``config`` is the architecture record.
    """
    dim = config.rope_dim  # head_dim x partial_rotary_factor; latent attention: qk_rope_head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    local_base = config.rope_local_base_freq if local else None
    theta = local_base or config.rope_theta
    pos_freqs = np.float32(theta) ** exponents
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    scaling = _scaling(config, local)
    kind = scaling.get("rope_type", "default")
    if kind in ("default", "dynamic"):
        return inv_freq
    if kind == "proportional":  # every pair (i, i + dim/2) listed, the unrotated ones at frequency 0
        angles = int(scaling.get("partial_rotary_factor", 1.0) * dim // 2)
        inv_freq = np.concatenate([inv_freq[:angles], np.zeros(dim // 2 - angles, np.float32)])
        return (inv_freq / np.float32(scaling.get("factor", 1.0))).astype(np.float32)
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "longrope":
        factors = np.asarray(scaling["long_factor" if long else "short_factor"], np.float32)
        return (np.float32(1.0) / (factors * pos_freqs)).astype(np.float32)
    if kind == "yarn":
        return _yarn_inv_freq(scaling, dim, theta, pos_freqs)
    if kind != "llama3":
        raise NotImplementedError(f"rope_scaling type {kind!r} (supported: default, {', '.join(ROPE_SCALING)})")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
    if high == low:  # no band between (Llama 4 Scout): transformers' smoothing divides by zero, unused
        return scaled.astype(np.float32)
    smooth = (np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(scaling, dim, theta, pos_freqs):
    """YaRN: interpolated (/ factor) below the correction range, extrapolated (as trained) above,
    a linear ramp between (``_compute_yarn_parameters``)."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = np.float32(1) - ramp.astype(np.float32)
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)


def _yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(config, local: bool = False) -> float:
    """The factor of the rotary cos and sin (so of the rotated features of q and k): YaRN's and
    longrope's ``attention_factor``, given or as transformers derives it; 1 otherwise."""
    scaling = _scaling(config, local)
    kind = scaling.get("rope_type", "default")
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / old_len
    if kind == "longrope":
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def rope_frequencies(config, positions, local: bool = False):
    """The layer's inverse frequencies for this call's ``positions`` [batch, length], and the
    cos/sin factor. Static for most types; two depend on the longest position, as in
    transformers' ``dynamic_rope_update``: longrope takes its long factors when any position is
    at or past ``original_max_position_embeddings`` (else the short ones), dynamic NTK raises
    the base to ``theta * (factor * S / max_position_embeddings - factor + 1) ** (d / (d - 2))``
    for ``S = max(positions) + 1`` beyond ``max_position_embeddings``."""
    scaling = _scaling(config, local)
    kind = scaling.get("rope_type", "default")
    inv_freq = rope_inv_freq(config, local)
    if kind not in ("longrope", "dynamic"):
        return inv_freq, rope_attention_factor(config, local)
    seq_len = jnp.max(positions) + 1
    if kind == "longrope":
        beyond = seq_len > scaling["original_max_position_embeddings"]
        return jnp.where(beyond, rope_inv_freq(config, local, long=True), inv_freq), rope_attention_factor(config, local)
    dim, max_len = 2 * inv_freq.shape[0], config.max_position_embeddings
    factor = scaling["factor"]
    grown = jnp.maximum(seq_len, max_len).astype(jnp.float32)
    base = config.rope_theta * (factor * grown / max_len - (factor - 1)) ** (dim / (dim - 2))
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    return jnp.where(seq_len > max_len, 1.0 / base ** exponents, inv_freq), 1.0


def check_rope_decoding(config, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse a longrope generation whose prefill is within ``original_max_position_embeddings``
    and whose later steps pass it: transformers (Phi-3) then recomputes the whole cache with the
    long factors, which a cache of short-rotated keys cannot do."""
    scaling = config.rope_scaling_dict
    if scaling.get("rope_type") == "longrope":
        old_len = scaling["original_max_position_embeddings"]
        if prompt_len <= old_len < prompt_len + max_new_tokens - 1:
            raise ModelError(f"longrope: a prompt of {prompt_len} tokens and {max_new_tokens} new ones cross "
                             f"original_max_position_embeddings={old_len} (short to long factors), which "
                             "decoding from a cache does not do; give a prompt beyond it or fewer new tokens")


def apply_rope(x, positions, inv_freq, attention_factor: float = 1.0, interleaved: bool = False):
    """Rotate the first ``2 * len(inv_freq)`` features of ``x``: feature i with i + rot/2
    (rotate-half, as HF Llama) or, ``interleaved``, feature 2i with 2i + 1 (as HF Cohere, which
    also turns them in float32); cos and sin times ``attention_factor`` (YaRN's, longrope's; as
    transformers).

    x: [batch, length, heads, head_dim]; positions: [batch, length].
    """
    rot = 2 * inv_freq.shape[0]
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [batch, length, rot/2]
    if interleaved:
        emb = jnp.repeat(freqs, 2, axis=-1)[:, :, None, :]  # [batch, length, 1, rot]: f0 f0 f1 f1 ...
    else:
        emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [batch, length, 1, rot]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if interleaved:
        x_rot, cos, sin = x_rot.astype(jnp.float32), cos.astype(jnp.float32), sin.astype(jnp.float32)
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = jnp.stack([-x2, x1], axis=-1).reshape(x_rot.shape)  # (-x1, x0, -x3, x2, ...)
    else:
        x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
        rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = (x_rot * cos + rotated * sin).astype(x.dtype)
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


def checked_rope_scaling(value, pairs: int):
    """``rope_scaling`` checked and canonical: None (plain rotary) or sorted (key, value) pairs
    (lists as tuples); ``pairs``: the rotated feature pairs, one longrope factor each."""
    if value is None:
        return None
    try:
        scaling = None if isinstance(value, str) else dict(value)
    except (TypeError, ValueError):
        scaling = None
    if scaling is None:
        raise ModelError(f"rope_scaling={value!r} is not a mapping such as "
                         "{rope_type: linear, factor: 2.0}; use null for none")
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return None
    if kind not in ROPE_SCALING:
        raise ModelError(f"rope_scaling rope_type={kind!r} is not one of default, {', '.join(ROPE_SCALING)}")
    for key in ROPE_SCALING[kind]:
        if key.endswith("_factor") and kind == "longrope":
            factors = scaling.get(key)
            if not isinstance(factors, (list, tuple)) or len(factors) != pairs or not all(map(positive, factors)):
                raise ModelError(f"rope_scaling of rope_type 'longrope' needs {key}: a list of {pairs} numbers "
                                 f"> 0 (one per rotated pair of head_dim), got {factors!r}")
            scaling[key] = tuple(factors)
        elif not positive(scaling.get(key)):
            raise ModelError(f"rope_scaling of rope_type {kind!r} needs {key} > 0, got {scaling.get(key)!r}")
    for key in ROPE_SCALING_OPTIONAL.get(kind, ()):
        value = scaling.get(key)
        if value is not None and not (positive(value) or (key.startswith("mscale") and value == 0)):
            raise ModelError(f"rope_scaling of rope_type {kind!r}: {key}={value!r} must be a number > 0 "
                             "(or null: transformers' default)")
    if kind == "yarn" and not isinstance(scaling.get("truncate", True), bool):
        raise ModelError(f"rope_scaling of rope_type 'yarn': truncate={scaling['truncate']!r} must be true or false")
    return tuple(sorted(scaling.items()))
