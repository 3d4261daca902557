"""The gated delta rule of linear attention (Qwen3-Next's Gated DeltaNet, ``models/linear_attention.py``;
Kimi's channel-wise decay, ``models/kimi_delta.py``): token by token, in chunks, and over a
context-parallel ring.

Per value head, a recurrent state S [key_dim, value_dim] follows the gated delta rule, token by
token: ``S = exp(g) S``; ``S += k (beta (v - S^T k))^T``; ``out = S^T q``; with q and k
L2-normalised (q also scaled by key_dim^-1/2), ``beta = sigmoid(b)`` and the log decay
``g = -exp(A_log) softplus(a + dt_bias)`` (transformers' ``torch_recurrent_gated_delta_rule``).
Training computes it in chunks (``gated_delta_chunked``, transformers' ``torch_chunk_gated_delta_rule``):
within a chunk of C tokens in parallel (a unit lower-triangular system, the WY/UT form, inverted by forward substitution), the state
carried from chunk to chunk by ``lax.scan``; decoding a token at a time (``gated_delta_step``).
A segment (packed rows) starts from a zero state.

Context parallelism (``length`` on the ring's mesh axes, tokens in the ring's zig-zag order,
``models/ring_attention.py``): device d holds chunks d and 2N-1-d of each row. A chunk's final
state is affine in its initial one, ``S_out = M S_in + B``: B is the chunk run from a zero state,
M the chunk run on the identity with zero values (no update: the product of its tokens'
``exp(g) (I - beta k k^T)``). The states then pass along the 2N chunks by ``ppermute`` (2N - 2
hops of [heads, key_dim, value_dim] per row), and each chunk runs again from its true initial
state (``ring_gated_delta``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from shardzoo.models.ring_attention import other_axes, spec_of
from shardzoo.sharding import axes as ax


def l2norm(x, eps: float = 1e-6):
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, float32 (fla's and transformers')."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def fill_defaults(seg, state, prev_seg, b, length, h, dk, dv):
    seg = jnp.zeros((b, length), jnp.int32) if seg is None else seg.astype(jnp.int32)
    state = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)
    prev_seg = seg[:, 0] if prev_seg is None else prev_seg.astype(jnp.int32)
    return seg, state, prev_seg


def gated_delta_step(q, k, v, g, beta, seg=None, state=None, prev_seg=None):
    """The gated delta rule token by token (decoding; the reference of the chunked form).

    q, k: [batch, length, heads, key_dim] (normalised, one per value head); v: [batch, length,
    heads, value_dim]; g (log decay): [batch, length, heads] (or per key channel, [batch, length,
    heads, key_dim]: ``models/kimi_delta.py``), beta: [batch, length, heads]; seg [batch, length] segment
    ids; state [batch, heads, key_dim, value_dim] (zeros when None), belonging to segment
    ``prev_seg`` [batch] (the first token's when None). Returns (out [batch, length, heads,
    value_dim] float32, the final state)."""
    b, length, h, dk = k.shape
    seg, state, prev_seg = fill_defaults(seg, state, prev_seg, b, length, h, dk, v.shape[-1])
    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # noqa: E731  [length, batch, ...]

    def step(carry, xs):
        s, prev = carry
        qt, kt, vt, gt, bt, st = xs
        s = jnp.where((st != prev)[:, None, None, None], 0.0, s)  # a new segment starts from zero
        decay = jnp.exp(gt)  # [batch, heads], or [batch, heads, key_dim] (channel-wise: Kimi's)
        s = s * decay.reshape(decay.shape + (1,) * (s.ndim - decay.ndim))
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
    seg, state, prev_seg = fill_defaults(seg, state, prev_seg, b, length, h, dk, dv)
    (q, k, v, g, beta), seg, prev = split_chunks((q, k, v, g, beta), seg, prev_seg, c)
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
    return merge_chunks(out, length), state


def split_chunks(xs, seg, prev_seg, chunk: int):
    """The chunked rules' inputs in chunks: each of ``xs`` [batch, length, heads, ...] as float32
    [n, batch, heads, chunk, ...] (padded: no decay (g 0), no update (k, v, beta 0)); the segment
    ids [n, batch, 1, chunk] (the padding in the last segment), and the segment of the token
    before each chunk [n, batch, 1, 1] (``prev_seg`` [batch] before the first)."""
    b, length = seg.shape
    n = -(-length // chunk)
    pad = n * chunk - length

    def chunks(x):  # [batch, length, heads, ...] -> [n, batch, heads, chunk, ...]
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((b, n, chunk) + x.shape[2:]), (1, 3), (0, 2))

    seg = jnp.concatenate([seg, jnp.repeat(seg[:, -1:], pad, axis=1)], axis=1).reshape(b, n, chunk)
    prev = jnp.concatenate([prev_seg[:, None], seg[:, :-1, -1]], axis=1)  # [batch, n]: the token before each chunk
    return [chunks(x) for x in xs], jnp.moveaxis(seg, 1, 0)[:, :, None], jnp.moveaxis(prev, 1, 0)[:, :, None, None]


def merge_chunks(out, length: int):
    """The scan's outputs [n, batch, heads, chunk, value_dim] as [batch, length, heads, value_dim]."""
    n, b, h, c, dv = out.shape
    return jnp.moveaxis(out, (0, 2), (1, 3)).reshape(b, n * c, h, dv)[:, :length]


# ------------------------------------------------------------------------ context parallelism
def _ring_local(q, k, v, g, beta, seg, *, axes, n, chunk, vary, rule):
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
        _, zero_in = rule(q_, k_, v_, g_, beta_, chunk, s_, zero, prev)
        _, m = rule(q_, k_, jnp.zeros_like(k_), g_, beta_, chunk, s_, eye, prev)
        return lambda s: jnp.einsum("bhkj,bhjv->bhkv", m, s) + zero_in

    f1, f2 = affine(parts[0], prev1), affine(parts[1], prev2)
    s1 = zero  # [batch, heads, key_dim, value_dim]
    for _ in range(n - 1):  # chunk d's initial state from device d - 1
        s1 = jax.lax.ppermute(f1(s1), axes, forward)
    out1 = f1(s1)
    s2 = jnp.where(d == n - 1, out1, 0.0)
    for _ in range(n - 1):  # chunk 2N-1-d's from device d + 1, device N - 1's from its first chunk
        s2 = jnp.where(d == n - 1, out1, jax.lax.ppermute(f2(s2), axes, backward))
    y1, _ = rule(*parts[0][:5], chunk, parts[0][5], s1, prev1)
    y2, _ = rule(*parts[1][:5], chunk, parts[1][5], s2, prev2)
    return jnp.concatenate([y1, y2], axis=1)


def ring_gated_delta(q, k, v, g, beta, seg, chunk: int, placement, rule=gated_delta_chunked):
    """``rule`` (a chunked delta rule: ``gated_delta_chunked``'s arguments and results) of
    length-sharded, zig-zag ordered rows over the placement's ring."""
    axes = placement.ring_axes
    n = placement.size(axes)
    batch = other_axes(placement, ax.BATCH, (q.shape[0],), axes)
    heads = other_axes(placement, ax.LINEAR_HEADS, (q.shape[2],), axes + batch)
    if seg is None:
        seg = jnp.ones(q.shape[:2], jnp.int32)
    x = spec_of(batch, axes, heads)
    fn = lambda *xs: _ring_local(*xs, axes=axes, n=n, chunk=chunk, vary=axes + batch + heads, rule=rule)  # noqa: E731
    return jax.shard_map(fn, mesh=placement.mesh, in_specs=(x, x, x, x, x, spec_of(batch, axes)),
                         out_specs=x)(q, k, v, g, beta, seg.astype(jnp.int32))
