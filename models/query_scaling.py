"""What Llama 4 does to its queries and keys beside rotary positions: the weightless L2 norm of
each head (``qk_norm="l2"``) and the attention temperature of its NoPE layers, a sub-record of
the attention mixer (``attn_temperature_tuning``); and Ministral 3's like temperature on every
layer (``llama_4_scaling``)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from shardzoo.models import ModelError
from shardzoo.models.component import SubRecord
from shardzoo.models.layers import positive


def l2_norm(x, eps: float):
    """Each head's features over their root mean square, no weight, in float32 (Llama 4's
    ``Llama4TextL2Norm``). x: [batch, length, heads, head_dim]."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class TemperatureTuning(SubRecord):
    """Llama 4's attention temperature on the NoPE layers (``attn_temperature_tuning``): queries at
    position p times 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)); dropped where every
    layer rotates."""

    NAME: ClassVar[str] = "attn_temperature_tuning"
    FEATURE: ClassVar[str] = "attention_temperature"
    FLAT: ClassVar[dict[str, str]] = {"floor_scale": "floor_scale", "attn_scale": "attn_scale"}

    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    def __post_init__(self):
        if not positive(self.floor_scale) or not (isinstance(self.attn_scale, (int, float))
                                                  and math.isfinite(self.attn_scale) and self.attn_scale >= 0):
            raise ModelError(f"floor_scale={self.floor_scale!r} must be a finite number > 0 and attn_scale="
                             f"{self.attn_scale!r} one >= 0 (attn_temperature_tuning)")

    def used(self, arch) -> bool:
        return any(s.rope == "none" for s in arch.layer_specs())


@dataclasses.dataclass(frozen=True)
class Llama4Scaling(SubRecord):
    """Ministral 3's query temperature on every layer (its ``rope_parameters``'
    ``llama_4_scaling_beta`` and ``original_max_position_embeddings``): queries at position p, after
    the rotary embedding, times 1 + beta * log(1 + floor(p / original_max_position_embeddings));
    beta 0 is none."""

    NAME: ClassVar[str] = "llama_4_scaling"
    FEATURE: ClassVar[str] = "llama_4_scaling"
    FLAT: ClassVar[dict[str, str]] = {"llama_4_scaling_beta": "beta",
                                      "llama_4_scaling_length": "original_max_position_embeddings"}

    beta: float = 0.0
    original_max_position_embeddings: int = 16384

    def __post_init__(self):
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta) and self.beta >= 0) or not (
                isinstance(self.original_max_position_embeddings, int) and self.original_max_position_embeddings > 0):
            raise ModelError(f"llama_4_scaling: beta={self.beta!r} must be a finite number >= 0 and "
                             f"original_max_position_embeddings={self.original_max_position_embeddings!r} "
                             "an integer > 0")

    def used(self, arch) -> bool:
        return self.beta != 0

    def check(self, arch) -> None:
        if arch.latent:
            raise ModelError("llama_4_scaling (Ministral 3's query temperature) is not implemented for latent "
                             "attention (kv_lora_rank)")


def temperature_tuned(q, positions, floor_scale: float, attn_scale: float, offset: float = 1.0):
    """Queries at position p times ``1 + attn_scale * log(1 + floor((p + offset) / floor_scale))``:
    Llama 4's attention temperature on its NoPE layers (offset 1; transformers takes p from the
    cache index, the same for unpacked rows), Ministral 3's on every layer (offset 0).
    q: [batch, length, heads, head_dim]."""
    p = positions.astype(jnp.float32)
    scale = jnp.log1p(jnp.floor((p + offset) / floor_scale)) * attn_scale + 1.0  # [batch, length]
    return (q * scale[:, :, None, None]).astype(q.dtype)
