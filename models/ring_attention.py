"""Context parallelism: ring attention over the mesh axes that hold the activations' length.

When the model's placement puts ``length`` on a context axis of size > 1 (``Placement.ring_axes``;
presets ``cp`` and ``cp_fsdp``), each of the N devices of the ring holds a slice
of every row. Attention then runs inside a ``jax.shard_map``: every device keeps its queries and
passes its key/value block to the next device N - 1 times with ``jax.lax.ppermute``, combining
the blocks it sees with an online (log-sum-exp) softmax in float32. No device ever holds the
whole row's keys and values.

Causal balance (dual-chunk / zig-zag): a row is cut into 2N chunks and device d holds chunks d
and 2N-1-d, so every device has as many early as late tokens. The model reorders its inputs,
positions and segment ids that way once, at the input (``zigzag``), and puts the hidden states
back in order before the output head (``unzigzag``), so the logits, the loss and every caller
see the natural order. The reorder moves half-slices between devices with ``ppermute`` (no
gather). Masks are computed from each block's real token indices and segment ids, so causality,
packed documents (segment ids) and sliding windows are exact; rotary positions travel with the
tokens. Then, after the diagonal step, exactly half of every block pair is visible: the late
query chunk always sees the early key chunk, and one more chunk pair (which one depends on
whether the keys come from an earlier or a later device) holds the rest; only those two
quarter-blocks are computed, the same work on every device.

The blocks are XLA einsums also where ``attention_impl`` picks splash (``auto`` on a TPU): a ring
step of the splash kernel would need its log-sum-exp residuals merged, forward and backward; not yet.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardzoo.models import ModelError
from shardzoo.sharding import axes as ax

# A large finite negative score for masked keys: no inf - inf in the online softmax.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


class ContextLengthError(ModelError):
    """The sequence length does not split into 2 x (context-parallel size) equal chunks."""


def check_length(length: int, placement) -> None:
    """A one-line error unless ``length`` splits into 2N equal chunks over the placement's ring."""
    axes = placement.ring_axes
    n = placement.size(axes)
    if length % (2 * n):
        shown = ",".join(f"{a}={placement.sizes[a]}" for a in axes)
        raise ContextLengthError(
            f"sequence length {length} is not divisible by {2 * n}: context parallelism over mesh "
            f"axis {shown} cuts each row into 2 x {n} equal chunks; use a multiple of {2 * n}"
        )


def enter_ring(placement, decode: bool, initializing: bool, *rows):
    """``(in ring, rows)``: under context parallelism the ``[batch, length]`` rows (inputs,
    positions, segment ids; None stays None) in the ring's order, else as given.

    The length is checked at init too (the error comes when the program is built); init itself
    runs the plain path (same parameters). Decoding never rings (its cache is not split by length).
    """
    if placement is None or decode or not placement.ring_axes:
        return False, rows
    check_length(rows[0].shape[1], placement)
    if initializing:
        return False, rows
    given = [r for r in rows if r is not None]
    moved = iter(jnp.unstack(zigzag(jnp.stack(given, axis=-1), placement), axis=-1))  # one reorder
    return True, tuple(None if r is None else next(moved).astype(r.dtype) for r in rows)


def other_axes(placement, names, dims: tuple[int, ...], exclude) -> tuple[str, ...]:
    """The mesh axes (size > 1, not in ``exclude``) the rules give a logical name, when they
    divide every one of ``dims``; else () (replicated inside the shard_map)."""
    found = tuple(a for a in placement.mesh_axes(names) if a not in exclude)
    size = placement.size(found)
    return found if all(d % size == 0 for d in dims) else ()


def spec_of(*dims):
    return P(*(d if d else None for d in dims))


# ------------------------------------------------------------------------------ the reorder
def _natural_home(c: int, n: int) -> tuple[int, int]:
    return c // 2, c % 2  # chunk c sits in half c % 2 of device c // 2


def _zigzag_home(c: int, n: int) -> tuple[int, int]:
    return (c, 0) if c < n else (2 * n - 1 - c, 1)  # device d holds chunks d and 2N-1-d


def _move(x, axes, n, src_home, dst_home):
    """Inside a shard_map: each device's two half-slices (along axis 1) go where ``dst_home``
    puts their chunk; one ppermute per (source half, destination half)."""
    halves = jnp.split(x, 2, axis=1)
    perms = {}
    for c in range(2 * n):
        (sd, sh), (dd, dh) = src_home(c, n), dst_home(c, n)
        perms.setdefault((sh, dh), []).append((sd, dd))
    out = [jnp.zeros_like(halves[0]), jnp.zeros_like(halves[1])]
    for (sh, dh), perm in sorted(perms.items()):
        out[dh] = out[dh] + jax.lax.ppermute(halves[sh], axes, perm)  # 0 where nothing arrives
    return jnp.concatenate(out, axis=1)


def _reorder(x, placement, src_home, dst_home):
    axes = placement.ring_axes
    n = placement.size(axes)
    batch = other_axes(placement, ax.BATCH, (x.shape[0],), axes)
    spec = spec_of(batch, axes, *([None] * (x.ndim - 2)))
    fn = lambda y: _move(y, axes, n, src_home, dst_home)  # noqa: E731
    return jax.shard_map(fn, mesh=placement.mesh, in_specs=spec, out_specs=spec)(x)


def zigzag(x, placement):
    """``[batch, length, ...]`` from the natural order to the ring's (device d: chunks d, 2N-1-d)."""
    return _reorder(x, placement, _natural_home, _zigzag_home)


def unzigzag(x, placement):
    """The inverse of ``zigzag``."""
    return _reorder(x, placement, _zigzag_home, _natural_home)


# ------------------------------------------------------------------------- ring attention
def _block(q, k, v, q_idx, k_idx, q_seg, k_seg, window, scale):
    """One block's unnormalised softmax statistics: (out, max, sum), float32.

    q [b, q_len, kv_heads, groups, head_dim]; k, v [b, k_len, kv_heads, head_dim]; *_idx
    [q_len] / [k_len] the tokens' indices in their row; *_seg [b, len] or None.
    """
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * scale
    mask = k_idx[None, :] <= q_idx[:, None]  # [q_len, k_len]
    if window:
        mask &= q_idx[:, None] - k_idx[None, :] < window
    mask = mask[None, None, None]
    if q_seg is not None:
        mask = mask & (q_seg[:, None, None, :, None] == k_seg[:, None, None, None, :])
    s = s + jnp.where(mask, 0.0, _MASKED)  # an added bias: the backward keeps no mask
    # The shift cancels in out / sum, so it takes no gradient (nor keeps max's residuals). A
    # query's masked keys give exp(_MASKED - max) = 0; a block that hides all of a query's keys
    # (max = _MASKED) gives garbage that the merge weighs by exp(_MASKED - max) = 0, since the
    # diagonal block, merged first, holds every query's own key.
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1))  # [b, kv_heads, groups, q_len]
    p = jnp.exp(s - m[..., None])
    o = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, m, jnp.sum(p, axis=-1)


def _t(w):
    """[b, kv_heads, groups, q_len] statistics to the output's [b, q_len, kv_heads, groups, 1]."""
    return jnp.transpose(w, (0, 3, 1, 2))[..., None]


def _merge(a, b):
    (oa, ma, la), (ob, mb, lb) = a, b
    m = jnp.maximum(ma, mb)
    wa, wb = jnp.exp(ma - m), jnp.exp(mb - m)  # [b, kv_heads, groups, q_len]
    return oa * _t(wa) + ob * _t(wb), m, la * wa + lb * wb


def _half(stats, i):
    o, m, s = stats
    q_len = o.shape[1] // 2
    sl = slice(i * q_len, (i + 1) * q_len)
    return o[:, sl], m[..., sl], s[..., sl]


def _pick(cond, a, b):
    return jax.tree.map(lambda x, y: jnp.where(cond, x, y), a, b)


def _indices(d, n: int, c: int):
    """The row indices of the 2C tokens that device ``d`` of a ring of ``n`` holds."""
    arange = jnp.arange(c)
    return jnp.concatenate([d * c + arange, (2 * n - 1 - d) * c + arange])


def _gathered_local(q, k, v, seg, *, axes, n, window, scale):
    """Per device: its queries against the whole row's keys and values, all-gathered (the
    ``all_gather`` strategy: one exchange, then the memory of a whole row's K/V and scores)."""
    b, two_c, nh, hd = q.shape
    nkv, c = k.shape[2], two_c // 2
    k, v = (jax.lax.all_gather(x, axes, axis=1, tiled=True) for x in (k, v))  # ring order
    k_seg = None if seg is None else jax.lax.all_gather(seg, axes, axis=1, tiled=True)
    k_idx = jnp.concatenate([_indices(d, n, c) for d in range(n)])
    q = q.reshape(b, two_c, nkv, nh // nkv, hd)
    q_idx = _indices(jax.lax.axis_index(axes), n, c)
    o, _, total = _block(q, k, v, q_idx, k_idx, seg, k_seg, window, scale)
    return (o / _t(total)).reshape(b, two_c, nh, hd).astype(v.dtype)


def _ring_local(q, k, v, seg, *, axes, n, window, scale):
    """Per device: q [b, 2C, heads, head_dim] (chunks i, 2N-1-i), k, v [b, 2C, kv_heads, head_dim]."""
    b, two_c, nh, hd = q.shape
    nkv, c = k.shape[2], two_c // 2
    i = jax.lax.axis_index(axes)

    def idx(d):
        return _indices(d, n, c)

    q = q.reshape(b, two_c, nkv, nh // nkv, hd)  # [b, 2C, kv_heads, groups, head_dim]
    q_idx = idx(i)
    halves = lambda x: jnp.split(x, 2, axis=1) if x is not None else (None, None)  # noqa: E731
    q1, q2 = halves(q)
    i1, i2 = q_idx[:c], q_idx[c:]
    s1, s2 = halves(seg)
    stats = _block(q, k, v, q_idx, q_idx, seg, seg, window, scale)  # the diagonal: all of it
    ring = [(d, (d + 1) % n) for d in range(n)]

    def step(carry, step):  # one scanned body for the N - 1 steps: one compile, any ring size
        kv, acc1, acc2 = carry
        kv = jax.lax.ppermute(kv, axes, ring)
        k, v, k_seg = kv
        j = (i - step) % n  # whose keys these are
        k_idx = idx(j)
        (k1, k2), (v1, v2), (ks1, ks2) = halves(k), halves(v), halves(k_seg)
        # The late query chunk sees the early key chunk whoever sent it.
        acc2 = _merge(acc2, _block(q2, k1, v1, i2, k_idx[:c], s2, ks1, window, scale))
        # Keys from an earlier device: the early queries see the early keys too; from a later
        # device: the late queries see the late keys too. The other pairs are all masked.
        early = j < i
        sel = lambda a, b: jnp.where(early, a, b) if a is not None else None  # noqa: E731
        extra = _block(sel(q1, q2), sel(k1, k2), sel(v1, v2), sel(i1, i2), sel(k_idx[:c], k_idx[c:]),
                       sel(s1, s2), sel(ks1, ks2), window, scale)
        acc1 = _pick(early, _merge(acc1, extra), acc1)
        acc2 = _pick(early, acc2, _merge(acc2, extra))
        return (kv, acc1, acc2), None

    carry = ((k, v, seg), _half(stats, 0), _half(stats, 1))
    (_, acc1, acc2), _ = jax.lax.scan(step, carry, jnp.arange(1, n))
    out = jnp.concatenate([acc1[0] / _t(acc1[2]), acc2[0] / _t(acc2[2])], axis=1)
    return out.reshape(b, two_c, nh, hd).astype(v.dtype)


STRATEGIES = ("ring", "all_gather")


def ring_attention(q, k, v, segment_ids, placement, *, sliding_window=None, scale=None, strategy="ring"):
    """Causal attention of length-sharded, zig-zag ordered ``q`` [batch, length, heads, head_dim]
    and ``k``, ``v`` [batch, length, kv_heads, head_dim] over the placement's ring.

    ``strategy``: "ring" passes K/V blocks around the ring; "all_gather" gathers the whole row's
    K/V on every device first (fewer, larger transfers; memory of a whole row's scores)."""
    axes = placement.ring_axes
    n = placement.size(axes)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    batch = other_axes(placement, ax.BATCH, (q.shape[0],), axes)
    heads = other_axes(placement, ax.HEADS, (q.shape[2], k.shape[2]), axes + batch)
    if heads != other_axes(placement, ax.KV_HEADS, (q.shape[2], k.shape[2]), axes + batch):
        heads = ()  # query and kv heads split alike, or neither
    qkv = spec_of(batch, axes, heads, None)
    local = _ring_local if strategy == "ring" else _gathered_local
    fn = lambda q, k, v, seg: local(  # noqa: E731
        q, k, v, seg, axes=axes, n=n, window=sliding_window, scale=scale)
    if segment_ids is None:
        return jax.shard_map(lambda q, k, v: fn(q, k, v, None), mesh=placement.mesh,
                             in_specs=(qkv, qkv, qkv), out_specs=qkv)(q, k, v)
    return jax.shard_map(fn, mesh=placement.mesh, in_specs=(qkv, qkv, qkv, spec_of(batch, axes)),
                         out_specs=qkv)(q, k, v, segment_ids)
