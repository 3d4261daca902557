"""Positions added to the token embeddings (``position_embedding``): a learned table (GPT-2, OPT)
or fixed sinusoids (XGLM), each read at ``position + position_offset`` (OPT and XGLM keep two
rows before position 0: a table of ``max_position_embeddings + position_offset`` rows). The other
kinds act inside attention: rotary embeddings (``models/rope.py``) and ALiBi (``models/alibi.py``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from shardzoo.models.layers import Embed
from shardzoo.sharding import axes as ax

KINDS = ("rope", "learned", "sinusoidal", "alibi")  # position_embedding's values


def sinusoids(positions, dim: int):
    """tensor2tensor's sinusoids (XGLM's, fairseq's): [sin(p f), cos(p f)] with f = 10000^(-i /
    (dim/2 - 1)) for i < dim/2, a zero column when ``dim`` is odd; float32 [..., dim]."""
    half = dim // 2
    freq = jnp.exp(jnp.arange(half, dtype=jnp.float32) * jnp.float32(-math.log(10000) / (half - 1)))
    angle = positions.astype(jnp.float32)[..., None] * freq
    out = jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)
    return jnp.pad(out, [(0, 0)] * (out.ndim - 1) + [(0, dim % 2)])


def add_positions(x, positions, arch, kw):
    """``x`` [batch, length, embed] plus its positions' embeddings, where they are added here
    (learned: the ``pos_embed`` table, created under the calling module)."""
    index = positions + arch.position_offset
    if arch.position_embedding == "learned":
        table = Embed(arch.max_position_embeddings + arch.position_offset, arch.hidden_size, ax.POSITION,
                      name="pos_embed", **kw)
        return x + table(index)
    if arch.position_embedding == "sinusoidal":
        return x + sinusoids(index, arch.hidden_size).astype(x.dtype)
    return x
