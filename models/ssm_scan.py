"""Mamba2's selective scan (the SSD form), token by token, in chunks, and over a context-parallel
ring: the recurrence of ``models/ssm.py``'s ``Mamba2Mixer``,

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t (+ D x_t, the mixer's),

per head h (heads share B and C by groups of ``num_heads / n_groups``).

Training computes the recurrence in chunks (``ssd``: the SSD form): within a chunk of
``mamba_chunk_size`` tokens, quadratically (an attention-like masked product); across chunks the
state is carried by ``lax.scan``. ``ssd_steps`` is the token-by-token recurrence (decoding, and
the tests' reference). Packed segments (segment ids) reset the state at a segment's start; a
left-padded prompt's padding is segment 0.

Context parallelism (``length`` on the ring's axes, tokens in the ring's zig-zag order): device d
holds chunks d and 2N-1-d of each row. The scan is linear in its initial state: each device scans its two chunks
from a zero state, giving outputs ``y0``, a final state ``S_loc`` and a per-head decay ``a``
(``exp(sum dt A)``, 0 across a segment start) with ``S_out = a * S_in + S_loc``. The incoming
states pass along the 2N chunks by ``ppermute`` (2N - 1 rounds of two permutes of one state each:
chunk i's state to chunk i + 1, forward over the first chunks, turning at device N - 1, backward
over the second), then each token adds ``exp(cumsum dt A) * C_t . S_in``. The sequence is never
gathered; only states [batch, heads, head_dim, state] move.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shardzoo.models import ModelError
from shardzoo.models.ring_attention import other_axes, spec_of
from shardzoo.sharding import axes as ax


# ------------------------------------------------------------------------------ the scan
def ssd(x, dt, A, B, C, chunk: int, seg=None, state=None, state_seg=None):
    """The chunked scan. x [batch, length, heads, head_dim]; dt [batch, length, heads] (after
    softplus and clamp); A [heads] (negative); B, C [batch, length, groups, state]; ``seg``
    [batch, length] segment ids (None: one segment); ``state`` [batch, heads, head_dim, state]
    before the first token (None: zeros) and ``state_seg`` [batch] its segment. Float32.
    Returns (y [batch, length, heads, head_dim] without the D skip, the final state)."""
    b, length, heads, p = x.shape
    groups, n = B.shape[2], B.shape[3]
    r = heads // groups
    f32 = jnp.float32
    x, dt, B, C = (t.astype(f32) for t in (x, dt, B, C))
    if seg is None:
        seg = jnp.ones((b, length), jnp.int32)
    if state_seg is None:
        state_seg = seg[:, 0]
    if state is None:
        state = jnp.zeros((b, heads, p, n), f32)
    pad = (-length) % chunk
    if pad:  # a padded tail: dt 0 (no decay, no input), its segment the last token's
        x, dt, B, C = (jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2)) for t in (x, dt, B, C))
        seg = jnp.pad(seg, ((0, 0), (0, pad)), mode="edge")
    nc, q = (length + pad) // chunk, chunk
    # [batch, chunks, chunk, groups, heads per group, ...]
    xg = x.reshape(b, nc, q, groups, r, p)
    dtg = dt.reshape(b, nc, q, groups, r)
    Bc, Cc = B.reshape(b, nc, q, groups, n), C.reshape(b, nc, q, groups, n)
    sg = seg.reshape(b, nc, q)
    cum = jnp.cumsum(dtg * A.astype(f32).reshape(groups, r), axis=2)  # [b, c, q, g, r]
    # within a chunk: y_l = sum_{s <= l, same segment} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s
    mask = (sg[:, :, :, None] == sg[:, :, None, :]) & jnp.tril(jnp.ones((q, q), bool))  # [b, c, l, s]
    m6 = mask[..., None, None]
    diff = cum[:, :, :, None] - cum[:, :, None, :]  # [b, c, l, s, g, r]
    decay = jnp.where(m6, jnp.exp(jnp.where(m6, diff, 0.0)), 0.0)
    cb = jnp.einsum("bclgn,bcsgn->bclsg", Cc, Bc)
    y = jnp.einsum("bclsgr,bcsgrp->bclgrp", cb[..., None] * decay * dtg[:, :, None], xg)
    # each chunk's own final state (from zero): its last segment's tokens, decayed to its end
    last = sg[:, :, -1]  # [b, c]
    keep = (sg == last[:, :, None]).astype(f32)[..., None, None]
    w = jnp.exp(cum[:, :, -1:] - cum) * dtg * keep  # [b, c, s, g, r]
    local = jnp.einsum("bcsgr,bcsgn,bcsgrp->bcgrpn", w, Bc, xg)
    # across chunks: the state entering chunk c, carried by a scan
    prev = jnp.concatenate([state_seg[:, None].astype(sg.dtype), last[:, :-1]], axis=1)  # [b, c]
    through = (last == prev).astype(f32)[..., None, None] * jnp.exp(cum[:, :, -1])  # [b, c, g, r]

    def step(s, inputs):
        a, own = inputs
        return a[..., None, None] * s + own, s

    # (+ 0 x a chunk's state: inside a shard_map the carry varies over the devices as the inputs do)
    s0 = state.astype(f32).reshape(b, groups, r, p, n) + 0.0 * local[:, 0]
    final, entering = jax.lax.scan(step, s0, (jnp.moveaxis(through, 1, 0), jnp.moveaxis(local, 1, 0)))
    entering = jnp.moveaxis(entering, 0, 1)  # [b, c, g, r, p, n]
    # the entering state's part of each output: exp(cum_l) C_l . S_in, within the entering segment
    reach = jnp.exp(cum) * (sg == prev[:, :, None]).astype(f32)[..., None, None]  # [b, c, l, g, r]
    y = y + jnp.einsum("bclgn,bcgrpn->bclgrp", Cc, entering) * reach[..., None]
    y = y.reshape(b, nc * q, heads, p)[:, :length]
    return y, final.reshape(b, heads, p, n)


def ssd_steps(x, dt, A, B, C, seg=None, state=None, state_seg=None):
    """The same recurrence token by token (decoding; the reference of ``ssd``); same arguments
    and results."""
    b, length, heads, p = x.shape
    groups, n = B.shape[2], B.shape[3]
    r, f32 = heads // groups, jnp.float32
    if seg is None:
        seg = jnp.ones((b, length), jnp.int32)
    if state_seg is None:
        state_seg = seg[:, 0]
    if state is None:
        state = jnp.zeros((b, heads, p, n), f32)

    def step(carry, inputs):
        s, s_seg = carry
        xt, dtt, bt, ct, st = inputs  # [b, h, p], [b, h], [b, g, n], [b, g, n], [b]
        bt, ct = jnp.repeat(bt, r, axis=1), jnp.repeat(ct, r, axis=1)  # [b, h, n]
        same = (st == s_seg).astype(f32)[:, None, None, None]
        s = same * jnp.exp(dtt * A)[..., None, None] * s + (dtt[..., None] * xt)[..., None] * bt[:, :, None, :]
        return (s, st), jnp.einsum("bhpn,bhn->bhp", s, ct)

    inputs = tuple(jnp.moveaxis(t.astype(f32) if t is not seg else t, 1, 0) for t in (x, dt, B, C, seg))
    (final, _), y = jax.lax.scan(step, (state.astype(f32), state_seg.astype(seg.dtype)), inputs)
    return jnp.moveaxis(y, 0, 1), final


# ------------------------------------------------------------------- context parallelism
def _ring_local(x, dt, A, B, C, seg, *, chunk, axes, n):
    """Per device: its two ring chunks (d and 2N-1-d) each scanned from zero, then the states
    passed along the 2N chunks and each token's part of its entering state added."""
    c = x.shape[1] // 2
    d = jax.lax.axis_index(axes)
    forward = [(i, i + 1) for i in range(n - 1)]
    backward = [(i + 1, i) for i in range(n - 1)]

    def halves(t):
        return t[:, :c], t[:, c:]

    def from_previous(first, second, fill):
        """Chunk i's value to chunk i + 1: the first chunks forward, the second backward, device
        N - 1's second chunk from its own first; chunk 0 gets ``fill``."""
        p1 = jax.lax.ppermute(first, axes, forward)
        p1 = jnp.where(d == 0, fill, p1)
        p2 = jnp.where(d == n - 1, first, jax.lax.ppermute(second, axes, backward))
        return p1, p2

    segs = halves(seg)
    prev_seg = from_previous(segs[0][:, -1], segs[1][:, -1], segs[0][:, 0])
    outs, locs, decays, reach = [], [], [], []
    A32 = A.astype(jnp.float32)
    for part, s_prev in zip(zip(*(halves(t) for t in (x, dt, B, C)), segs, strict=True), prev_seg, strict=True):
        (xi, dti, bi, ci), si = part[:4], part[4]
        y, s_loc = ssd(xi, dti, A, bi, ci, chunk, si, None, s_prev)
        cum = jnp.cumsum(dti.astype(jnp.float32) * A32, axis=1)  # [b, c, h]
        within = (si == s_prev[:, None]).astype(jnp.float32)  # [b, c]: in the entering segment
        outs.append(y)
        locs.append(s_loc)
        decays.append(jnp.exp(cum[:, -1]) * within[:, -1:])  # [b, h]
        reach.append(jnp.exp(cum) * within[..., None])  # [b, c, h]
    zero = jnp.zeros_like(locs[0])
    s1 = s2 = zero  # the states entering the two chunks, exact after 2N - 1 rounds
    for _ in range(2 * n - 1):
        out1 = decays[0][..., None, None] * s1 + locs[0]
        out2 = decays[1][..., None, None] * s2 + locs[1]
        s1, s2 = from_previous(out1, out2, zero)
    groups = B.shape[2]
    r = x.shape[2] // groups
    ys = []
    for y, s_in, ci, rc in zip(outs, (s1, s2), halves(C), reach, strict=True):
        cr = jnp.repeat(ci.astype(jnp.float32), r, axis=2)  # [b, c, h, n]
        ys.append(y + jnp.einsum("blhn,bhpn->blhp", cr, s_in) * rc[..., None])
    return jnp.concatenate(ys, axis=1)


def ring_ssd(x, dt, A, B, C, seg, chunk: int, placement):
    """``ssd`` (its outputs) of length-sharded, zig-zag ordered inputs over the placement's ring."""
    axes = placement.ring_axes
    n = placement.size(axes)
    batch = other_axes(placement, ax.BATCH, (x.shape[0],), axes)
    heads = other_axes(placement, ax.SSM_HEADS, (x.shape[2],), axes + batch)
    if heads:  # the scan's heads split over devices would need B, C per head: keep them whole here
        raise ModelError("context parallelism of mamba layers runs with ssm_heads unsharded beside it")
    if seg is None:
        seg = jnp.ones(x.shape[:2], jnp.int32)
    xs, ts = spec_of(batch, axes, None, None), spec_of(batch, axes, None)
    fn = lambda *a: _ring_local(*a, chunk=chunk, axes=axes, n=n)  # noqa: E731
    return jax.shard_map(fn, mesh=placement.mesh, in_specs=(xs, ts, spec_of(None), xs, xs, spec_of(batch, axes)),
                         out_specs=xs)(x, dt, A, B, C, seg)
