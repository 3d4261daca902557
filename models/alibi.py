"""ALiBi (attention with linear biases; BLOOM, MPT): no position embedding, but each head's
attention logits biased by ``slope[head] * (key position - query position)``, a penalty growing
linearly with the distance to an earlier key. Attention (``models/attention.py``) adds the bias
in its plain XLA path (splash attention takes no bias: ``models/splash.py`` says so).

transformers adds ``slope * key position`` (BLOOM) or ``slope * (key - last key)`` (MPT): the
same softmax, each query's row shifted by a constant. Relative to the query, the bias is right
for packed segments (positions restart) and for a decoding cache (slots: each row's offset is
the same for its query and its keys). Under context parallelism it runs as attention sinks do:
plain XLA attention over the sharded length, not the ring.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

BIAS_MAX = 8  # the largest exponent: the slopes run 2^(-8/n) ... 2^-8 (BLOOM's; MPT's alibi_bias_max)


def slopes(heads: int) -> np.ndarray:
    """Each head's slope, float32 [heads]: 2^(-8 i / n) for i = 1..n with n the power of two at
    or above ``heads``; with fewer heads, the odd i first then the even ones, cut to ``heads``
    (MPT's ``build_mpt_alibi_tensor``; BLOOM's ``_get_alibi_slopes`` gives the same numbers)."""
    n = 2 ** math.ceil(math.log2(heads))
    out = 1.0 / np.power(2.0, np.arange(1, n + 1, dtype=np.float64) * (BIAS_MAX / n))
    if n != heads:
        out = np.concatenate([out[1::2], out[::2]])[:heads]
    return out.astype(np.float32)


def alibi_bias(heads: int, q_positions, k_positions):
    """The additive logits' bias, float32 [batch, heads, q_len, k_len]: ``slope * (k - q)``.
    q_positions: [batch, q_len]; k_positions: [batch, k_len] (positions, or cache slots)."""
    distance = (k_positions[:, None, None, :] - q_positions[:, None, :, None]).astype(jnp.float32)
    return jnp.asarray(slopes(heads))[None, :, None, None] * distance
