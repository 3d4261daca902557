"""Kimi delta attention (KDA): Kimi-Linear's linear attention, a token mixer in place of
attention on its "linear_attention" layers (``layer_types`` "kimi_delta" here).

Gated DeltaNet (``models/linear_attention.py``) with its decay per key channel instead of per
head: per head, a recurrent state S [head_dim, head_dim] follows, token by token,
``S = diag(exp(g)) S``; ``S += k (beta (v - S^T k))^T``; ``out = S^T q``, with q and k
L2-normalised (q also scaled by head_dim^-1/2), ``beta = sigmoid(b)`` and the log decay
``g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias)`` [heads, head_dim] (transformers'
``recurrent_kimi_delta_attention``, fla's ``fused_recurrent_kda``). Decoding runs that step
(``gated_delta_step``, which takes either decay); training the chunked form
(``kimi_delta_chunked``, transformers' ``chunk_kimi_delta_attention``): within a chunk of C
tokens, the decays D[i, j, d] = exp(c_i - c_j) of each key channel d (c the cumulative log
decay, j <= i, same segment) weigh each product of keys, queries and keys; the rest is Gated
DeltaNet's (the unit lower-triangular system, the state carried from chunk to chunk).

The block (``KimiDeltaAttention``): q, k, v [heads, head_dim] projected from the input, each
through its causal depthwise convolution and SiLU (Gated DeltaNet's ``conv_silu``); b [heads];
the decay's and the output gate's low-rank projections (``f_a``/``f_b``, ``g_a``/``g_b``:
hidden -> head_dim -> heads x head_dim); the output RMS-normalised per head (one weight) in
float32, times sigmoid(gate), then projected out. Packed rows, the decoding cache (state,
its segment, the convolution's last inputs) and context parallelism (the chunk's affine state
map passed along the ring, ``ring_gated_delta``) are Gated DeltaNet's, run on this rule.

The explicit decays cost C x head_dim floats per token and head in a chunk (Gated DeltaNet's:
C): ``linear_attention_chunk`` sets C.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from shardzoo.models import ModelError, check_fields
from shardzoo.models.component import Mixer, SubRecord
from shardzoo.models.delta_rule import (
    fill_defaults,
    l2norm,
    merge_chunks,
    split_chunks,
    unit_lower_inverse,
)
from shardzoo.models.features import feature
from shardzoo.models.layers import Linear, constrain, dtype_of, linear_kw
from shardzoo.models.linear_attention import GatedDeltaNet
from shardzoo.sharding import axes as ax

KIMI = "kimi_delta"  # its name in layer_types (Kimi-Linear's "linear_attention" layers)
BHD = (ax.BATCH, ax.LENGTH, ax.LINEAR_HEADS, ax.LINEAR_KEY_DIM)  # q, k, the decay
BHV = (ax.BATCH, ax.LENGTH, ax.LINEAR_HEADS, ax.LINEAR_VALUE_DIM)  # v, the output, its gate


@dataclasses.dataclass(frozen=True)
class KimiDelta(SubRecord):
    """KDA's sizes, the architecture's ``kimi_delta`` (Kimi-Linear's ``linear_attn_config``):
    heads, each head's features (queries, keys and values alike; also the rank of the decay's and
    the gate's projections) and the taps of the short convolution. Ling's (``bailing_hybrid``):
    ``full_rank_gate``, the decay's and the gate's projections each one hidden -> heads x head_dim
    matrix (``f``, ``g``); ``gate_lower_bound`` b, the log decay ``b sigmoid(exp(A_log) (f +
    dt_bias))`` in (b, 0) (fla's safe gate) in place of ``-exp(A_log) softplus(f + dt_bias)``."""

    NAME: ClassVar[str] = "kimi_delta"
    FEATURE: ClassVar[str] = "kimi_delta"
    OWNERS: ClassVar[tuple[str, ...]] = (KIMI,)

    num_heads: int = 32
    head_dim: int = 128
    conv_kernel: int = 4
    full_rank_gate: bool = feature(False, "kda_full_rank_gate")
    gate_lower_bound: float | None = feature(None, "kda_gate_lower_bound")

    def __post_init__(self):
        check_fields(self, {}, ("num_heads", "head_dim", "conv_kernel"))
        if None in (self.num_heads, self.head_dim, self.conv_kernel) or self.conv_kernel < 2:
            raise ModelError(f"kimi_delta: num_heads={self.num_heads}, head_dim={self.head_dim} and conv_kernel="
                             f"{self.conv_kernel} must be set, conv_kernel >= 2 (the taps of the causal convolution "
                             "of q, k and v)")
        if self.gate_lower_bound is not None and not (isinstance(self.gate_lower_bound, (int, float))
                                                      and -math.inf < self.gate_lower_bound < 0):
            raise ModelError(f"kimi_delta: gate_lower_bound={self.gate_lower_bound!r} must be a finite number < 0 "
                             "(the least log decay; or null: softplus)")


def kimi_delta_chunked(q, k, v, g, beta, chunk: int, seg=None, state=None, prev_seg=None):
    """The delta rule with a decay per key channel, in chunks of ``chunk`` tokens; equal to
    ``gated_delta_step`` with g [batch, length, heads, key_dim] (same arguments and results).
    Gated DeltaNet's chunked form (``gated_delta_chunked``) with each product of two tokens'
    key features weighted by that feature's decay between them."""
    b, length, h, dk = k.shape
    dv, c = v.shape[-1], chunk
    seg, state, prev_seg = fill_defaults(seg, state, prev_seg, b, length, h, dk, dv)
    (q, k, v, g, beta), seg, prev = split_chunks((q, k, v, g, beta), seg, prev_seg, c)
    # q, k, g: [n, batch, heads, c, key_dim]; v: [.., value_dim]; beta [n, batch, heads, c]; seg [n, batch, 1, c]
    cum = jnp.cumsum(g, axis=-2)
    same = ((seg[..., :, None] == seg[..., None, :]) & jnp.tril(jnp.ones((c, c), bool)))[..., None]
    diff = cum[..., :, None, :] - cum[..., None, :, :]  # [n, batch, heads, c, c, key_dim]
    decay = jnp.where(same, jnp.exp(jnp.where(same, diff, 0.0)), 0.0)
    from_start = jnp.where((seg == prev)[..., None], jnp.exp(cum), 0.0)  # the initial state's decay to each token
    to_end = jnp.where((seg == seg[..., -1:])[..., None], jnp.exp(cum[..., -1:, :] - cum), 0.0)
    kb, vb = k * beta[..., None], v * beta[..., None]
    system = jnp.einsum("...id,...jd,...ijd->...ij", kb, k, decay) * np.tri(c, k=-1, dtype=np.float32)
    inverse = unit_lower_inverse(system)  # [n, batch, heads, c, c]: (I + system)^-1
    u, w = inverse @ vb, inverse @ (kb * from_start)  # [n, batch, heads, c, value_dim | key_dim]
    qd, kd = q * from_start, k * to_end
    intra = jnp.einsum("...id,...jd,...ijd->...ij", q, k, decay)  # [n, batch, heads, c, c]
    keep = from_start[..., -1, :]  # [n, batch, heads, key_dim]: the initial state's decay through the chunk

    def step(s, xs):
        u, w, qd, kd, intra, keep = xs
        new = u - w @ s  # [batch, heads, c, value_dim]
        out = qd @ s + intra @ new
        return s * keep[..., None] + jnp.swapaxes(kd, -1, -2) @ new, out

    state, out = jax.lax.scan(step, state, (u, w, qd, kd, intra, keep))
    return merge_chunks(out, length), state


def gated_sigmoid_norm(x, gate, scale, eps: float):
    """``scale * rms_norm(x) * sigmoid(gate)`` over each head's features, in float32 (transformers'
    ``KimiLinearRMSNormGated``), rounded to x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (scale.astype(jnp.float32) * normed * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)


def _a_log_init(key, shape, dtype):
    """log A, A uniform in [1, 16) (transformers' and fla's initialisation)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def _dt_bias_init(key, shape, dtype):
    """softplus^-1(dt), dt log-uniform in [1e-3, 1e-1) (transformers' initialisation)."""
    dt = jnp.maximum(jnp.exp(jax.random.uniform(key, shape, jnp.float32, np.log(1e-3), np.log(1e-1))), 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class KimiDeltaAttention(GatedDeltaNet):
    """Kimi delta attention (see the module doc). Parameters: ``q``, ``k``, ``v``, ``b``, the
    convolution's taps ``conv_q``, ``conv_k``, ``conv_v`` (transformers' conv1d, split), ``f_a``,
    ``f_b``, ``dt_bias`` [heads, head_dim], ``A_log`` [heads], ``g_a``, ``g_b``, ``norm`` and ``out``."""

    def rule(self, *args):
        return kimi_delta_chunked(*args)

    @nn.compact
    def __call__(self, x, segment_ids=None, decode: bool = False):
        a, e, placement = self.config.arch, self.config.execution, self.placement
        kda = a.kimi_delta
        h, d = kda.num_heads, kda.head_dim
        kw, pdt = linear_kw(self.config), dtype_of(e.param_dtype)
        heads_k, heads_v = (ax.LINEAR_HEADS, ax.LINEAR_KEY_DIM), (ax.LINEAR_HEADS, ax.LINEAR_VALUE_DIM)
        q, k = (Linear((h, d), (ax.EMBED, *heads_k), name=n, **kw)(x) for n in "qk")
        v = Linear((h, d), (ax.EMBED, *heads_v), name="v", **kw)(x)
        b = Linear((h,), (ax.EMBED, ax.LINEAR_HEADS), name="b", **kw)(x)  # [batch, length, heads]
        seg = self.segments(x, segment_ids, decode)
        q, k, v = self.conv_silu({"q": (q, BHD), "k": (k, BHD), "v": (v, BHV)}, seg, decode, kda.conv_kernel)
        f = self._gate_projection(x, "f", heads_k)  # [batch, length, heads, head_dim]
        a_log = self.param("A_log", nn.with_logical_partitioning(_a_log_init, (ax.LINEAR_HEADS,)), (h,), pdt)
        dt_bias = self.param("dt_bias", nn.with_logical_partitioning(_dt_bias_init, heads_k), (h, d), pdt)
        rate, f = jnp.exp(a_log.astype(jnp.float32))[:, None], f.astype(jnp.float32) + dt_bias.astype(jnp.float32)
        if kda.gate_lower_bound is None:
            g = -rate * jax.nn.softplus(f)  # [batch, length, heads, key_dim]: log decays
        else:  # Ling's safe gate: in (lower bound, 0)
            g = kda.gate_lower_bound * jax.nn.sigmoid(rate * f)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        out = self.delta(l2norm(q) * d**-0.5, l2norm(k), v, constrain(g, BHD, placement), beta, seg, decode)
        out = constrain(out.astype(x.dtype), BHV, placement)  # [batch, length, heads, head_dim]
        gate = self._gate_projection(x, "g", heads_v)
        scale = self.param("norm", nn.with_logical_partitioning(nn.initializers.ones, (ax.LINEAR_VALUE_DIM,)),
                           (d,), pdt)
        y = checkpoint_name(constrain(gated_sigmoid_norm(out, gate, scale, a.rms_norm_eps), BHV, placement),
                            "attn_context")
        out = Linear((a.hidden_size,), (*heads_v, ax.EMBED), name="out", **kw)(y)
        return checkpoint_name(out, "attn_out")  # [batch, length, embed]: the mixer's output

    def _gate_projection(self, x, name: str, axes):
        """The decay's (``f``) or the gate's (``g``) projection to [batch, length, heads, head_dim]:
        one matrix (``full_rank_gate``), or ``{name}_a`` then ``{name}_b`` through head_dim features
        (named as the other side's head features)."""
        kda, kw = self.config.arch.kimi_delta, linear_kw(self.config)
        h, d = kda.num_heads, kda.head_dim
        if kda.full_rank_gate:
            return Linear((h, d), (ax.EMBED, *axes), name=name, **kw)(x)
        middle = ax.LINEAR_VALUE_DIM if name == "f" else ax.LINEAR_KEY_DIM
        low = Linear((d,), (ax.EMBED, middle), name=f"{name}_a", **kw)(x)
        return Linear((h, d), (middle, *axes), name=f"{name}_b", **kw)(low)


# ------------------------------------------------------------------------------ the component
def _apply(block, h, positions, segment_ids):
    """The mixer of a "kimi_delta" layer: KDA of the normed input ``h`` (its path: ``linear_attn``)."""
    return KimiDeltaAttention(block.config, block.placement, name="linear_attn")(h, segment_ids, block.decode)


def params(a) -> tuple[int, int]:
    """(q, k, v, b, the decay's and the gate's low-rank pairs, out and the convolution's taps;
    A_log per head, dt_bias per head and feature, the norm's weight)."""
    kda = a.kimi_delta
    h, d, hd = kda.num_heads, kda.head_dim, kda.num_heads * kda.head_dim
    gates = 2 * a.hidden_size * hd if kda.full_rank_gate else 2 * (a.hidden_size * d + d * hd)
    matmul = a.hidden_size * (3 * hd + h) + gates + hd * a.hidden_size + kda.conv_kernel * 3 * hd
    return matmul, h + hd + d


def flops(a, spec, seq_len: int) -> float:
    """Per head and token: four state products (decay, read, update, output); in a chunk of 64,
    the decayed k.k and q.k products over head_dim (and the decays) and (q k) v with 32 earlier
    tokens on average; 2 x 3 FLOPs per multiply-add, as attention's."""
    d = a.kimi_delta.head_dim
    return 6 * a.kimi_delta.num_heads * (4 * d * d + 32 * (5 * d))


def activations(cost, spec=None) -> dict:
    """What one KDA layer keeps for the backward pass (``cost.t``: the bytes of one activation):
    the projections (q, k, v, b, the two low-rank pairs), the
    convolution's outputs and masks, the normalised q, k and the decays (float32), a chunk's
    explicit decays, their exponents and the two products they weigh (about 3.5 x chunk x
    head_dim per token and head, as XLA's CPU step of kimi-linear-tiny keeps at chunks of 16 and
    64), its systems, inputs and states, the output and its gated norm's inputs."""
    a, t, chunk = cost.config.arch, cost.t, cost.config.execution.linear_attention_chunk
    kda = a.kimi_delta
    h, d = kda.num_heads, kda.head_dim
    hd, heads = h * d, (ax.BATCH, ax.LENGTH, ax.LINEAR_HEADS)
    return {"kda_in": t(3 * hd + h + 2 * d + 2 * hd, heads), "kda_conv": t(6 * hd, heads),
            "conv_masks": t(3 * kda.conv_kernel, heads[:2], 4), "kda_qkg": t(4 * hd, heads, 4),
            "kda_chunk": t(h * (3.5 * chunk * d + 7 * chunk + 11 * d + d * d / chunk), heads, 4),
            "kda_out": t(3 * hd, heads, 4), "attn_context": t(hd, heads)}


def cache_bytes(a, batch: int, length: int, nbytes: int) -> int:
    """The float32 state per head, its segment id, and the convolution's last inputs (q, k, v)."""
    kda = a.kimi_delta
    hd = kda.num_heads * kda.head_dim
    return batch * (4 * hd * kda.head_dim + 4 + (kda.conv_kernel - 1) * (3 * hd * nbytes + 4))


MIXER = Mixer(KIMI, (KIMI,), _apply, params, flops, activations=activations, cache_bytes=cache_bytes,
              records=(KimiDelta,),
              context_parallel="Gated DeltaNet's: each chunk's final state affine in its initial one, passed along "
                               "the ring's chunks by ppermute (ring_gated_delta on kimi_delta_chunked); the taps as "
                               "the short convolution's")
