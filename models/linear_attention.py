"""Gated DeltaNet: Qwen3-Next's linear attention, a token mixer in place of attention on its
"linear_attention" layers.

Per value head, a recurrent state S [key_dim, value_dim] follows the gated delta rule, token by
token: ``S = exp(g) S``; ``S += k (beta (v - S^T k))^T``; ``out = S^T q``; with q and k
L2-normalised (q also scaled by key_dim^-1/2), ``beta = sigmoid(b)`` and the log decay
``g = -exp(A_log) softplus(a + dt_bias)`` (transformers' ``torch_recurrent_gated_delta_rule``).
Training computes it in chunks (``gated_delta_chunked``, transformers' ``torch_chunk_gated_delta_rule``):
within a chunk of C tokens in parallel (a unit lower-triangular system, the WY/UT form, inverted by forward substitution), the state
carried from chunk to chunk by ``lax.scan``; decoding a token at a time (``gated_delta_step``).

The block (``GatedDeltaNet``): q, k [key heads, key_dim], v, z [value heads, value_dim] and
b, a [value heads] projected from the input; q, k and v each through a causal depthwise
convolution (``conv_mixer.causal_conv``) and SiLU; each key head serves value_heads / key_heads
consecutive value heads; the output RMS-normalised per head (one weight), times silu(z), then
projected out.

Packed rows: a segment starts with a zero state, and the convolution's taps see nothing across a
segment's start (segment ids; a segment occupies consecutive tokens). Decoding keeps each
layer's state, its segment id and the convolution's last w - 1 inputs in the "cache" collection.

Context parallelism (``length`` on the ring's mesh axes, tokens in the ring's zig-zag order,
``models/ring_attention.py``): device d holds chunks d and 2N-1-d of each row. A chunk's final
state is affine in its initial one, ``S_out = M S_in + B``: B is the chunk run from a zero state,
M the chunk run on the identity with zero values (no update: the product of its tokens'
``exp(g) (I - beta k k^T)``). The states then pass along the 2N chunks by ``ppermute`` (2N - 2
hops of [heads, key_dim, value_dim] per row), and each chunk runs again from its true initial
state. The convolution's taps take the previous chunk's tail as LFM2's do (``ring_conv``); the
sequence is never gathered.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from shardzoo.models import ModelError
from shardzoo.models.component import Mixer, SubRecord
from shardzoo.models.conv_mixer import causal_conv, check_ring_chunk, ring_conv
from shardzoo.models.layers import Linear, constrain, dtype_of, fused, linear_kw
from shardzoo.models.ring_attention import other_axes, spec_of
from shardzoo.sharding import axes as ax

LINEAR = "linear_attention"  # its name in layer_types
BLKD = (ax.BATCH, ax.LENGTH, ax.LINEAR_KEY_HEADS, ax.LINEAR_KEY_DIM)
BLVD = (ax.BATCH, ax.LENGTH, ax.LINEAR_HEADS, ax.LINEAR_VALUE_DIM)
STATE = (ax.BATCH, ax.LINEAR_HEADS, ax.LINEAR_KEY_DIM, ax.LINEAR_VALUE_DIM)


def l2norm(x, eps: float = 1e-6):
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, float32 (fla's and transformers')."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _defaults(seg, state, prev_seg, b, length, h, dk, dv):
    seg = jnp.zeros((b, length), jnp.int32) if seg is None else seg.astype(jnp.int32)
    state = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)
    prev_seg = seg[:, 0] if prev_seg is None else prev_seg.astype(jnp.int32)
    return seg, state, prev_seg


def gated_delta_step(q, k, v, g, beta, seg=None, state=None, prev_seg=None):
    """The gated delta rule token by token (decoding; the reference of the chunked form).

    q, k: [batch, length, heads, key_dim] (normalised, one per value head); v: [batch, length,
    heads, value_dim]; g (log decay), beta: [batch, length, heads]; seg [batch, length] segment
    ids; state [batch, heads, key_dim, value_dim] (zeros when None), belonging to segment
    ``prev_seg`` [batch] (the first token's when None). Returns (out [batch, length, heads,
    value_dim] float32, the final state)."""
    b, length, h, dk = k.shape
    seg, state, prev_seg = _defaults(seg, state, prev_seg, b, length, h, dk, v.shape[-1])
    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # noqa: E731  [length, batch, ...]

    def step(carry, xs):
        s, prev = carry
        qt, kt, vt, gt, bt, st = xs
        s = jnp.where((st != prev)[:, None, None, None], 0.0, s)  # a new segment starts from zero
        s = s * jnp.exp(gt)[..., None, None]
        delta = (vt - jnp.einsum("bhkv,bhk->bhv", s, kt)) * bt[..., None]
        s = s + kt[..., None] * delta[..., None, :]
        return (s, st), jnp.einsum("bhkv,bhk->bhv", s, qt)

    (state, _), out = jax.lax.scan(step, (state, prev_seg), (f32(q), f32(k), f32(v), f32(g), f32(beta),
                                                              jnp.moveaxis(seg, 1, 0)))
    return jnp.moveaxis(out, 0, 1), state


@jax.custom_vjp
def unit_lower_inverse(strict):
    """``(I + strict)^-1`` of strictly lower-triangular ``strict`` [..., c, c], by forward
    substitution, row by row (as transformers' chunked rule does): row i is e_i - strict[i] @ the
    rows before it. Plain matrix products in a loop of c steps, where XLA's CPU triangular solve
    inside the step could hang at long sequences; the gradient is -T^T G T^T (T the inverse), kept
    strictly lower."""
    return _forward_substitution(strict)


def _forward_substitution(strict):
    c = strict.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(c, dtype=strict.dtype), strict.shape)

    def row(i, inverse):
        r = jax.lax.dynamic_index_in_dim(strict, i, axis=-2, keepdims=True)  # [..., 1, c]
        new = jax.lax.dynamic_index_in_dim(eye, i, axis=-2, keepdims=True) - r @ inverse
        return jax.lax.dynamic_update_index_in_dim(inverse, new, i, axis=-2)

    # the carry varies over a shard_map's axes as ``strict`` does (0 * strict: its type, no values)
    return jax.lax.fori_loop(1, c, row, eye + 0 * strict)


def _inverse_fwd(strict):
    inverse = _forward_substitution(strict)
    return inverse, inverse


def _inverse_bwd(inverse, g):
    t = jnp.swapaxes(inverse, -1, -2)
    return (-(t @ g @ t) * np.tri(g.shape[-1], k=-1, dtype=g.dtype),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def gated_delta_chunked(q, k, v, g, beta, chunk: int, seg=None, state=None, prev_seg=None):
    """The gated delta rule in chunks of ``chunk`` tokens: equal to ``gated_delta_step`` (same
    arguments and results). Within a chunk, with cumulative log decays c and the decays
    D[i, j] = exp(c_i - c_j) (j <= i, same segment): the unit lower-triangular system
    T = I + strict_lower(beta k k^T * D) gives the new values u = T^-1 (beta v) and the state's
    read-out w = T^-1 (beta k exp(c)) (``unit_lower_inverse``); per chunk then ``v' = u - w S``,
    ``out = (q exp(c)) S + (q k^T * D) v'``, ``S = exp(c_last) S + (k exp(c_last - c))^T v'``."""
    b, length, h, dk = k.shape
    dv, c = v.shape[-1], chunk
    seg, state, prev_seg = _defaults(seg, state, prev_seg, b, length, h, dk, dv)
    n = -(-length // c)
    pad = n * c - length  # padded tokens: no decay (g 0), no update (k, v, beta 0), the last segment

    def chunks(x):  # [batch, length, heads, ...] -> [n, batch, heads, c, ...]
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((b, n, c) + x.shape[2:])
        return jnp.moveaxis(x, (1, 3), (0, 2))

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    seg = jnp.concatenate([seg, jnp.repeat(seg[:, -1:], pad, axis=1)], axis=1).reshape(b, n, c)
    prev = jnp.concatenate([prev_seg[:, None], seg[:, :-1, -1]], axis=1)  # [batch, n]: the token before each chunk
    seg, prev = jnp.moveaxis(seg, 1, 0)[:, :, None], jnp.moveaxis(prev, 1, 0)[:, :, None, None]
    # seg: [n, batch, 1, c]; prev: [n, batch, 1, 1]
    cum = jnp.cumsum(g, axis=-1)  # [n, batch, heads, c]
    same = (seg[..., :, None] == seg[..., None, :]) & jnp.tril(jnp.ones((c, c), bool))  # [n, batch, 1, c, c]
    decay = jnp.where(same, jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    from_start = jnp.where(seg == prev, jnp.exp(cum), 0.0)  # the initial state's decay to each token
    to_end = jnp.where(seg == seg[..., -1:], jnp.exp(cum[..., -1:] - cum), 0.0)  # each token's to the chunk's end
    kb, vb = k * beta[..., None], v * beta[..., None]
    system = jnp.einsum("...id,...jd->...ij", kb, k) * decay * np.tri(c, k=-1, dtype=np.float32)
    inverse = unit_lower_inverse(system)  # [n, batch, heads, c, c]: (I + system)^-1
    u, w = inverse @ vb, inverse @ (kb * from_start[..., None])  # [n, batch, heads, c, value_dim | key_dim]
    qd, kd = q * from_start[..., None], k * to_end[..., None]
    intra = jnp.einsum("...id,...jd->...ij", q, k) * decay  # [n, batch, heads, c, c]
    keep = from_start[..., -1]  # [n, batch, heads]: the initial state's decay through the chunk

    def step(s, xs):
        u, w, qd, kd, intra, keep = xs
        new = u - w @ s  # [batch, heads, c, value_dim]
        out = qd @ s + intra @ new
        return s * keep[..., None, None] + jnp.swapaxes(kd, -1, -2) @ new, out

    state, out = jax.lax.scan(step, state, (u, w, qd, kd, intra, keep))
    out = jnp.moveaxis(out, (0, 2), (1, 3)).reshape(b, n * c, h, dv)  # [batch, length, heads, value_dim]
    return out[:, :length], state


# ------------------------------------------------------------------------ context parallelism
def _ring_local(q, k, v, g, beta, seg, *, axes, n, chunk, vary):
    """Per device: the rows' chunks d and 2N-1-d (each [batch, C, ...]); see the module doc."""
    half = q.shape[1] // 2
    d = jax.lax.axis_index(axes)
    forward = [(i, i + 1) for i in range(n - 1)]  # chunk i to chunk i + 1 (device 0 receives zeros)
    backward = [(i + 1, i) for i in range(n - 1)]  # chunk 2N-1-(i+1) to chunk 2N-1-i
    parts = [tuple(x[:, sl] for x in (q, k, v, g, beta, seg)) for sl in (slice(0, half), slice(half, None))]
    # the segment id before each chunk: chunk d's from device d - 1, chunk 2N-1-d's from device d + 1
    # (device N - 1: its own first chunk's last)
    last1, last2 = parts[0][5][:, -1], parts[1][5][:, -1]
    prev1 = jnp.where(d == 0, parts[0][5][:, 0], jax.lax.ppermute(last1, axes, forward))
    prev2 = jnp.where(d == n - 1, last1, jax.lax.ppermute(last2, axes, backward))
    b, _, h, dk = k.shape
    # the constants varying as the inputs do (over the ring, the batch's and the heads' axes)
    eye = jax.lax.pcast(jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, h, dk, dk)), vary, to="varying")
    zero = jax.lax.pcast(jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32), vary, to="varying")

    def affine(p, prev):  # the chunk's final state as M S_in + B
        q_, k_, v_, g_, beta_, s_ = p
        _, zero_in = gated_delta_chunked(q_, k_, v_, g_, beta_, chunk, s_, zero, prev)
        _, m = gated_delta_chunked(q_, k_, jnp.zeros_like(k_), g_, beta_, chunk, s_, eye, prev)
        return lambda s: jnp.einsum("bhkj,bhjv->bhkv", m, s) + zero_in

    f1, f2 = affine(parts[0], prev1), affine(parts[1], prev2)
    s1 = zero  # [batch, heads, key_dim, value_dim]
    for _ in range(n - 1):  # chunk d's initial state from device d - 1
        s1 = jax.lax.ppermute(f1(s1), axes, forward)
    out1 = f1(s1)
    s2 = jnp.where(d == n - 1, out1, 0.0)
    for _ in range(n - 1):  # chunk 2N-1-d's from device d + 1, device N - 1's from its first chunk
        s2 = jnp.where(d == n - 1, out1, jax.lax.ppermute(f2(s2), axes, backward))
    y1, _ = gated_delta_chunked(*parts[0][:5], chunk, parts[0][5], s1, prev1)
    y2, _ = gated_delta_chunked(*parts[1][:5], chunk, parts[1][5], s2, prev2)
    return jnp.concatenate([y1, y2], axis=1)


def ring_gated_delta(q, k, v, g, beta, seg, chunk: int, placement):
    """``gated_delta_chunked`` of length-sharded, zig-zag ordered rows over the placement's ring."""
    axes = placement.ring_axes
    n = placement.size(axes)
    batch = other_axes(placement, ax.BATCH, (q.shape[0],), axes)
    heads = other_axes(placement, ax.LINEAR_HEADS, (q.shape[2],), axes + batch)
    if seg is None:
        seg = jnp.ones(q.shape[:2], jnp.int32)
    x = spec_of(batch, axes, heads)
    fn = lambda *xs: _ring_local(*xs, axes=axes, n=n, chunk=chunk, vary=axes + batch + heads)  # noqa: E731
    return jax.shard_map(fn, mesh=placement.mesh, in_specs=(x, x, x, x, x, spec_of(batch, axes)),
                         out_specs=x)(q, k, v, g, beta, seg.astype(jnp.int32))


# ------------------------------------------------------------------------------------ the block
def gated_rms_norm(x, z, scale, eps: float):
    """``scale * rms_norm(x) * silu(z)`` over each head's features (transformers'
    ``Qwen3NextRMSNormGated``: the norm in float32, rounded to x's dtype before the scale)."""
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    y = (scale.astype(x.dtype) * normed).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    return y.astype(x.dtype)


def _a_log_init(key, shape, dtype):
    """log A, A uniform in [0.01, 16) (transformers' initialisation)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's Gated DeltaNet (see the module doc). Parameters: ``q``, ``k``, ``v``, ``z``,
    ``b``, ``a`` (transformers' in_proj_qkvz and in_proj_ba, split), the convolution's taps
    ``conv_q``, ``conv_k``, ``conv_v`` (its conv1d, split), ``A_log``, ``dt_bias``, ``norm``
    and ``out``."""

    config: object
    placement: object = None

    @nn.compact
    def __call__(self, x, segment_ids=None, decode: bool = False):
        a, e, placement = self.config.arch, self.config.execution, self.placement
        la = a.linear_attention
        nk, nv = la.num_key_heads, la.num_value_heads
        dk, dv, w = la.key_head_dim, la.value_head_dim, la.conv_kernel_dim
        kw, pdt = linear_kw(self.config), dtype_of(e.param_dtype)
        key_axes, value_axes = (ax.LINEAR_KEY_HEADS, ax.LINEAR_KEY_DIM), (ax.LINEAR_HEADS, ax.LINEAR_VALUE_DIM)
        pairs = [[Linear(shape, (ax.EMBED, *axes), name=n, **kw) for n in names]
                 for names, shape, axes in (("qk", (nk, dk), key_axes), ("vz", (nv, dv), value_axes),
                                            ("ba", (nv,), (ax.LINEAR_HEADS,)))]
        project = fused if e.fuse_projections else lambda lins, x: [lin(x) for lin in lins]
        (q, k), (v, z), (b, a_) = (project(p, x) for p in pairs)
        # q, k: [batch, length, key_heads, key_dim]; v, z: [batch, length, heads, value_dim]; b, a: [batch, length, heads]
        ring = placement.ring_axes if placement is not None and not decode else ()
        taps = {n: self.param(f"conv_{n}", nn.with_logical_partitioning(
            nn.initializers.normal(a.initializer_range), (ax.CONV_WIDTH, *axes)), (w, *shape), pdt)
            for n, axes, shape in (("q", key_axes, (nk, dk)), ("k", key_axes, (nk, dk)), ("v", value_axes, (nv, dv)))}
        seg = segment_ids
        if decode:
            seg = jnp.ones(x.shape[:2], jnp.int32) if seg is None else seg.astype(jnp.int32)
            conv_cache = self._conv_cache(x.shape[0], w, nk, nv, dk, dv)
            prev = {n: (var.value.reshape(x.shape[0], w - 1, -1), conv_cache[1].value)
                    for n, var in conv_cache[0].items()}
        convolved, inputs = {}, {}
        for n, y, axes in (("q", q, BLKD), ("k", k, BLKD), ("v", v, BLVD)):
            y = inputs[n] = constrain(y, axes, placement)
            flat, kernel = y.reshape(y.shape[:2] + (-1,)), taps[n].reshape(w, -1)
            if decode:
                out = causal_conv(flat, kernel, seg, *prev[n])
            elif ring and not self.is_initializing():
                out = ring_conv(flat, kernel, seg, placement)
            else:
                if ring:  # init runs the plain path; the length is checked when the program is built
                    check_ring_chunk(flat.shape[1], w, placement)
                out = causal_conv(flat, kernel, seg)
            convolved[n] = jax.nn.silu(out).reshape(y.shape)
        if decode:
            _push(*conv_cache, inputs, seg)
        q, k, v = convolved["q"], convolved["k"], convolved["v"]
        a_log = self.param("A_log", nn.with_logical_partitioning(_a_log_init, (ax.LINEAR_HEADS,)), (nv,), pdt)
        dt_bias = self.param("dt_bias", nn.with_logical_partitioning(nn.initializers.ones, (ax.LINEAR_HEADS,)),
                             (nv,), pdt)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a_.astype(jnp.float32) + dt_bias.astype(jnp.float32))
        r = nv // nk  # each key head serves r consecutive value heads
        q = jnp.repeat(l2norm(q) * dk**-0.5, r, axis=2)  # [batch, length, heads, key_dim]
        k = jnp.repeat(l2norm(k), r, axis=2)
        chunk = e.linear_attention_chunk
        if decode:
            out = self._recurrent(q, k, v, g, beta, seg, chunk, nv, dk, dv)
        elif ring and not self.is_initializing():
            out = ring_gated_delta(q, k, v, g, beta, seg, chunk, placement)
        else:
            out, _ = gated_delta_chunked(q, k, v, g, beta, chunk, seg)
        out = constrain(out.astype(x.dtype), BLVD, placement)  # [batch, length, heads, value_dim]
        # the gated RMSNorm of each head (one weight for all heads): norm(out) * silu(z)
        scale = self.param("norm", nn.with_logical_partitioning(nn.initializers.ones, (ax.LINEAR_VALUE_DIM,)),
                           (dv,), pdt)
        y = checkpoint_name(constrain(gated_rms_norm(out, z, scale, a.rms_norm_eps), BLVD, placement), "attn_context")
        out = Linear((a.hidden_size,), (*value_axes, ax.EMBED), name="out", **kw)(y)
        return checkpoint_name(out, "attn_out")  # [batch, length, embed]: the mixer's output

    def _cached(self, name, shape, axes, dtype):
        return self.variable("cache", name, nn.with_logical_partitioning(jnp.zeros, axes), shape, dtype)

    def _conv_cache(self, batch, w, nk, nv, dk, dv):
        """The cache variables of the convolution's last w - 1 inputs (q, k and v) and their
        segment ids."""
        h = w - 1
        key_axes = (ax.BATCH, ax.CONV_WIDTH, ax.LINEAR_KEY_HEADS, ax.LINEAR_KEY_DIM)
        value_axes = (ax.BATCH, ax.CONV_WIDTH, ax.LINEAR_HEADS, ax.LINEAR_VALUE_DIM)
        dt = dtype_of(self.config.execution.dtype)
        inputs = {n: self._cached(f"conv_{n}", (batch, h) + shape, axes, dt)
                  for n, shape, axes in (("q", (nk, dk), key_axes), ("k", (nk, dk), key_axes), ("v", (nv, dv), value_axes))}
        return inputs, self._cached("conv_segment_ids", (batch, h), (ax.BATCH, ax.CONV_WIDTH), jnp.int32)

    def _recurrent(self, q, k, v, g, beta, seg, chunk, nv, dk, dv):
        """Decoding: the rule from the cached state (a prompt in chunks, a token by the step),
        and the cache moved on (state, its segment, the convolution's last inputs)."""
        batch = q.shape[0]
        state = self._cached("recurrent_state", (batch, nv, dk, dv), STATE, jnp.float32)
        state_seg = self._cached("state_segment_id", (batch,), (ax.BATCH,), jnp.int32)
        if q.shape[1] == 1:
            out, new = gated_delta_step(q, k, v, g, beta, seg, state.value, state_seg.value)
        else:
            out, new = gated_delta_chunked(q, k, v, g, beta, chunk, seg, state.value, state_seg.value)
        state.value, state_seg.value = new, seg[:, -1]
        return out


def _push(variables, seg_variable, inputs, seg):
    """The convolution's cache moved on by this call's inputs: its last w - 1 (and their segments)."""
    h = seg_variable.value.shape[1]
    for n, var in variables.items():
        var.value = jnp.concatenate([var.value, inputs[n].astype(var.value.dtype)], axis=1)[:, -h:]
    seg_variable.value = jnp.concatenate([seg_variable.value, seg], axis=1)[:, -h:]


# ------------------------------------------------------------------------------ the component
@dataclasses.dataclass(frozen=True)
class GatedDeltaNetArch(SubRecord):
    """The linear-attention layers' sizes: q, k num_key_heads x key_head_dim, v, z num_value_heads
    x value_head_dim, the causal convolution's conv_kernel_dim taps (Qwen3-Next's linear_* fields)."""

    NAME: ClassVar[str] = "linear_attention"
    FEATURE: ClassVar[str] = "gated_deltanet"
    OWNERS: ClassVar[tuple[str, ...]] = (LINEAR,)
    FLAT: ClassVar[dict[str, str]] = {f"linear_{n}": n for n in (
        "num_value_heads", "num_key_heads", "key_head_dim", "value_head_dim", "conv_kernel_dim")}

    num_value_heads: int | None = None
    num_key_heads: int | None = None
    key_head_dim: int | None = None
    value_head_dim: int | None = None
    conv_kernel_dim: int | None = None

    def check(self, arch) -> None:
        for flat, name in self.FLAT.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"layer_types has {LINEAR} layers: {flat}={value!r} must be an integer >= 1")
        if self.conv_kernel_dim < 2:
            raise ModelError(f"linear_conv_kernel_dim={self.conv_kernel_dim} must be >= 2 (the taps of the "
                             "causal convolution of q, k and v)")
        if self.num_value_heads % self.num_key_heads:
            raise ModelError(f"linear_num_value_heads={self.num_value_heads} must be a multiple of "
                             f"linear_num_key_heads={self.num_key_heads} (each key head serves as many value heads)")


def _apply(block, h, positions, segment_ids):
    return GatedDeltaNet(block.config, block.placement, name="linear_attn")(h, segment_ids, block.decode)


def params(a) -> tuple[int, int]:
    """(the projections q, k, v, z, b, a, out and the convolution's taps; A_log and dt_bias per
    value head, the gated norm's weight)."""
    la = a.linear_attention
    keys, values = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
    proj = a.hidden_size * (2 * keys + 2 * values + 2 * la.num_value_heads) + values * a.hidden_size
    matmul = proj + la.conv_kernel_dim * (2 * keys + values)
    return matmul, 2 * la.num_value_heads + la.value_head_dim


def flops(a, spec, seq_len: int) -> float:
    """Per head: three state products, a chunk of 64's q.k, k.k and (q k) v; 2 x 3 FLOPs per multiply-add."""
    la = a.linear_attention
    dk, dv = la.key_head_dim, la.value_head_dim
    return 6 * la.num_value_heads * (3 * dk * dv + 32 * (2 * dk + dv))


def activations(cost, spec=None) -> dict:
    """gdn_in, gdn_conv, conv_masks, gdn_qk, gdn_chunk, gdn_out, attn_context (models/costs.py's doc)."""
    a, t, chunk = cost.config.arch, cost.t, cost.config.execution.linear_attention_chunk
    la = a.linear_attention
    nk, nv, dk, dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
    heads = (ax.BATCH, ax.LENGTH, ax.LINEAR_HEADS)
    qkv = 2 * nk * dk + nv * dv
    return {"gdn_in": t(qkv + nv * dv + 2 * nv, heads), "gdn_conv": t(2 * qkv, heads),
            "conv_masks": t(3 * la.conv_kernel_dim, heads[:2], 4), "gdn_qk": t(2 * nv * dk, heads, 4),
            "gdn_chunk": t(nv * (7 * chunk + 3 * dk + dv + dk * dv / chunk), heads, 4),
            "gdn_out": t(2 * nv * dv, heads, 4), "attn_context": t(nv * dv, heads)}


def cache_bytes(a, batch: int, length: int, nbytes: int) -> int:
    """The float32 state per value head, its segment id, and the convolution's last inputs."""
    la = a.linear_attention
    nk, nv = la.num_key_heads, la.num_value_heads
    dk, dv, h = la.key_head_dim, la.value_head_dim, la.conv_kernel_dim - 1
    return batch * (4 * nv * dk * dv + 4 + h * ((2 * nk * dk + nv * dv) * nbytes + 4))


def check(a) -> None:
    if a.latent:
        raise ModelError(f"layer_types has {LINEAR} layers beside latent attention (kv_lora_rank), "
                         "which no family has; remove one")


MIXER = Mixer(LINEAR, (LINEAR,), _apply, params, flops, activations=activations, cache_bytes=cache_bytes,
              check=check, records=(GatedDeltaNetArch,), context_parallel="each chunk's final state affine in its initial one, the states "
                                            "passed along the ring's chunks by ppermute (ring_gated_delta); the "
                                            "convolution's taps as the short convolution's")
