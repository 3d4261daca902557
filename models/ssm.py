"""Mamba2's selective state-space mixer: the token mixer of the "mamba" layers (Mamba2, Bamba,
Nemotron-H), in attention's place.

``Mamba2Mixer``: ``z, x, B, C, dt = in_proj(h)``; ``x, B, C`` each through a causal depthwise
convolution (``conv_mixer.causal_conv``, with bias) and SiLU; ``dt = clamp(softplus(dt +
dt_bias), time_step_limit)``; ``A = -exp(A_log)``; per head h (heads share B and C by groups of
``num_heads / n_groups``) the state S [head_dim, state] runs

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t + D x_t,

then the gated RMSNorm ``norm(y * silu(z))`` over each group of ``num_heads / n_groups`` heads'
features (transformers' ``MambaRMSNormGated``; ``mamba_norm``: or ``norm(y) * silu(z)``, or
``y * silu(z)`` without a norm) and ``out_proj``. Falcon-H1's ``multipliers.ssm`` scale in_proj's
five outputs.

Training computes the recurrence in chunks (``ssd``: the SSD form): within a chunk of
``mamba_chunk_size`` tokens, quadratically (an attention-like masked product); across chunks the
state is carried by ``lax.scan``. ``ssd_steps`` is the token-by-token recurrence (decoding, and
the tests' reference). Packed segments (segment ids) reset the state at a segment's start; a
left-padded prompt's padding is segment 0.

Decoding keeps, per mamba layer, the convolutions' last w - 1 inputs and their segment ids, and
the state [batch, ssm_heads, ssm_head_dim, ssm_state] with the segment id it belongs to.

Context parallelism (``length`` on the ring's axes, tokens in the ring's zig-zag order): device d
holds chunks d and 2N-1-d of each row. The convolutions pass their w - 1 input tails as
``ring_conv`` does. The scan is linear in its initial state: each device scans its two chunks
from a zero state, giving outputs ``y0``, a final state ``S_loc`` and a per-head decay ``a``
(``exp(sum dt A)``, 0 across a segment start) with ``S_out = a * S_in + S_loc``. The incoming
states pass along the 2N chunks by ``ppermute`` (2N - 1 rounds of two permutes of one state each:
chunk i's state to chunk i + 1, forward over the first chunks, turning at device N - 1, backward
over the second), then each token adds ``exp(cumsum dt A) * C_t . S_in``. The sequence is never
gathered; only states [batch, heads, head_dim, state] move.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from shardzoo.models import ModelError, attention
from shardzoo.models.component import Mixer, SubRecord
from shardzoo.models.conv_mixer import causal_conv, ring_conv
from shardzoo.models.features import feature
from shardzoo.models.layers import NO_MULTIPLIERS, Linear, constrain, dtype_of, linear_kw, scaled
from shardzoo.models.ring_attention import other_axes, spec_of
from shardzoo.sharding import axes as ax

MAMBA = "mamba"  # its name in layer_types
# attention and a Mamba2 mixer side by side on one norm, their outputs summed (Falcon-H1, whose
# transformers config calls every layer "hybrid"): x + attn(norm(x)) + mamba(norm(x)), then the MLP
ATTENTION_MAMBA = "attention+mamba"
BLHP = (ax.BATCH, ax.LENGTH, ax.SSM_HEADS, ax.SSM_HEAD_DIM)
BLGN = (ax.BATCH, ax.LENGTH, ax.SSM_GROUPS, ax.SSM_STATE)
STATE = (ax.BATCH, ax.SSM_HEADS, ax.SSM_HEAD_DIM, ax.SSM_STATE)


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


# --------------------------------------------------------------------------------- the mixer
def gated_rms_norm(y, z, scale, groups: int, eps: float, before_gate: bool = False):
    """transformers' ``MambaRMSNormGated``: ``y * silu(z)`` RMS-normalised over each group of
    heads' features, times ``scale`` (``before_gate``: ``y`` normalised, then times ``scale`` and
    ``silu(z)``: Falcon-H1's ``mamba_norm_before_gate``). y, z [batch, length, heads, head_dim];
    scale [heads, head_dim]."""
    b, length, heads, p = y.shape
    gate = jax.nn.silu(z.astype(jnp.float32))
    h = y.astype(jnp.float32) if before_gate else y.astype(jnp.float32) * gate
    h = h.reshape(b, length, groups, heads // groups * p)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    h = h.reshape(b, length, heads, p) * scale.astype(jnp.float32)
    return (h * gate if before_gate else h).astype(y.dtype)


class Mamba2Mixer(nn.Module):
    """Mamba2's mixer (see the module doc). Parameters: ``in_z``, ``in_x`` [embed, ssm_heads,
    ssm_head_dim], ``in_b``, ``in_c`` [embed, ssm_groups, ssm_state], ``in_dt`` [embed, ssm_heads]
    (transformers' in_proj in five), ``conv_x``, ``conv_b``, ``conv_c`` (taps [conv_width, ...]
    and ``bias``), ``dt_bias``, ``A_log``, ``D`` [ssm_heads], ``norm`` [ssm_heads, ssm_head_dim],
    ``out`` [ssm_heads, ssm_head_dim, embed]."""

    config: object
    placement: object = None

    @nn.compact
    def __call__(self, h, segment_ids=None, decode: bool = False):
        a, placement = self.config.arch, self.placement
        heads, p, g, n = a.mamba.num_heads, a.mamba.head_dim, a.mamba.n_groups, a.mamba.state_size
        kw, pdt = linear_kw(self.config), dtype_of(self.config.execution.param_dtype)
        bias = a.mamba.proj_bias
        z = Linear((heads, p), (ax.EMBED, ax.SSM_HEADS, ax.SSM_HEAD_DIM), bias, name="in_z", **kw)(h)
        x = Linear((heads, p), (ax.EMBED, ax.SSM_HEADS, ax.SSM_HEAD_DIM), bias, name="in_x", **kw)(h)
        B = Linear((g, n), (ax.EMBED, ax.SSM_GROUPS, ax.SSM_STATE), bias, name="in_b", **kw)(h)
        C = Linear((g, n), (ax.EMBED, ax.SSM_GROUPS, ax.SSM_STATE), bias, name="in_c", **kw)(h)
        dt = Linear((heads,), (ax.EMBED, ax.SSM_HEADS), bias, name="in_dt", **kw)(h)  # [batch, length, ssm_heads]
        # Falcon-H1's muP vector: each of in_proj's outputs (bias included) times its multiplier
        z, x, B, C, dt = (t if m == 1.0 else t * jnp.asarray(m, t.dtype)
                          for t, m in zip((z, x, B, C, dt), (a.multipliers or NO_MULTIPLIERS).ssm, strict=True))
        x, B, C = constrain(x, BLHP, placement), constrain(B, BLGN, placement), constrain(C, BLGN, placement)
        ring = placement.ring_axes if placement is not None and not decode and not self.is_initializing() else ()
        seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
        if decode and seg is None:
            seg = jnp.ones(h.shape[:2], jnp.int32)
        x = self._conv("x", x, (ax.SSM_HEADS, ax.SSM_HEAD_DIM), seg, decode, ring)
        B = self._conv("b", B, (ax.SSM_GROUPS, ax.SSM_STATE), seg, decode, ring)
        C = self._conv("c", C, (ax.SSM_GROUPS, ax.SSM_STATE), seg, decode, ring)

        def vector(name, init):
            return self.param(name, nn.with_logical_partitioning(init, (ax.SSM_HEADS,)), (heads,), pdt)

        dt_bias = vector("dt_bias", nn.initializers.zeros)
        A_log = vector("A_log", lambda key, shape, dtype: jnp.log(jnp.arange(1, shape[0] + 1, dtype=dtype)))
        D = vector("D", nn.initializers.ones)
        lo, hi = a.mamba.time_step_limit
        dt = jnp.clip(jax.nn.softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32)), lo, hi)
        A = -jnp.exp(A_log.astype(jnp.float32))
        if decode:
            y = self._continue(x, dt, A, B, C, seg)
        elif ring:
            y = ring_ssd(x, dt, A, B, C, seg, a.mamba.chunk_size, placement)
        else:
            y, _ = ssd(x, dt, A, B, C, a.mamba.chunk_size, seg)
        y = y + x.astype(jnp.float32) * D.astype(jnp.float32)[:, None]
        y = checkpoint_name(constrain(y.astype(h.dtype), BLHP, placement), "ssm_out")
        if a.mamba.norm == "none":  # the gate without a norm (Falcon-H1's mamba_rms_norm false)
            y = (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(y.dtype)
        else:
            scale = self.param("norm", nn.with_logical_partitioning(nn.initializers.ones, (ax.SSM_HEADS,
                                                                                            ax.SSM_HEAD_DIM)),
                               (heads, p), pdt)
            y = gated_rms_norm(y, z, scale, g, a.rms_norm_eps, a.mamba.norm == "before_gate")
        y = checkpoint_name(constrain(y, BLHP, placement), "attn_context")
        out = Linear((a.hidden_size,), (ax.SSM_HEADS, ax.SSM_HEAD_DIM, ax.EMBED), bias, name="out", **kw)(y)
        return checkpoint_name(out, "attn_out")  # [batch, length, embed]

    def _conv(self, name, t, axes, seg, decode, ring):
        """SiLU(causal depthwise conv + bias) of t [batch, length, *feature dims]; decoding
        continues the cached inputs; under context parallelism the ring passes the tails."""
        a = self.config.arch
        w, pdt = a.mamba.conv_kernel, dtype_of(self.config.execution.param_dtype)
        dims = t.shape[2:]
        kernel = self.param(f"conv_{name}", nn.with_logical_partitioning(
            nn.initializers.normal(a.initializer_range), (ax.CONV_WIDTH,) + axes), (w,) + dims, pdt)
        flat, k = t.reshape(t.shape[:2] + (-1,)), kernel.reshape(w, -1)
        if decode:
            h = w - 1
            state = self.variable("cache", f"conv_{name}_state", nn.with_logical_partitioning(jnp.zeros, (
                ax.BATCH, ax.CONV_WIDTH) + axes), (t.shape[0], h) + dims, t.dtype)
            state_seg = self.variable("cache", f"conv_{name}_segment_ids", nn.with_logical_partitioning(
                jnp.zeros, (ax.BATCH, ax.CONV_WIDTH)), (t.shape[0], h), jnp.int32)
            prev = state.value.reshape(t.shape[0], h, -1)
            out = causal_conv(flat, k, seg, prev, state_seg.value)
            state.value = jnp.concatenate([state.value, t], axis=1)[:, -h:]
            state_seg.value = jnp.concatenate([state_seg.value, seg], axis=1)[:, -h:]
        elif ring:
            out = ring_conv(flat, k, seg, self.placement, axes[0])
        else:
            out = causal_conv(flat, k, seg)
        if a.mamba.conv_bias:
            bias = self.param(f"conv_{name}_bias", nn.with_logical_partitioning(nn.initializers.zeros, axes), dims, pdt)
            out = out + bias.reshape(-1).astype(out.dtype)
        return jax.nn.silu(out).reshape(t.shape)

    def _continue(self, x, dt, A, B, C, seg):
        """The scan continuing the cached state (a prompt in chunks, a token by the recurrence)."""
        a = self.config.arch
        batch, heads, p, n = x.shape[0], a.mamba.num_heads, a.mamba.head_dim, a.mamba.state_size
        state = self.variable("cache", "ssm_state", nn.with_logical_partitioning(jnp.zeros, STATE),
                              (batch, heads, p, n), jnp.float32)
        state_seg = self.variable("cache", "ssm_segment_ids", nn.with_logical_partitioning(jnp.zeros, (ax.BATCH,)),
                                  (batch,), jnp.int32)
        if x.shape[1] == 1:
            y, final = ssd_steps(x, dt, A, B, C, seg, state.value, state_seg.value)
        else:
            y, final = ssd(x, dt, A, B, C, a.mamba.chunk_size, seg, state.value, state_seg.value)
        state.value, state_seg.value = final, seg[:, -1]
        return y


# ------------------------------------------------------------------------------ the component
def _apply(block, h, positions, segment_ids):
    """The mixer of ``h``, its input and output scaled by the ssm multipliers (Falcon-H1's; 1 elsewhere)."""
    m = block.config.arch.multipliers or NO_MULTIPLIERS
    out = Mamba2Mixer(block.config, block.placement, name="mamba")(scaled(h, m.ssm_in), segment_ids, block.decode)
    return scaled(out, m.ssm_out)


def params(a) -> tuple[int, int]:
    """(in_proj (z, x, B, C, dt), out_proj and the convolution's taps over x, B, C; dt_bias, A_log,
    D, the gated norm, the biases)."""
    d, inner, gn, h = a.hidden_size, a.mamba.inner, a.mamba.n_groups * a.mamba.state_size, a.mamba.num_heads
    matmul = d * (2 * inner + 2 * gn + h) + inner * d + a.mamba.conv_kernel * (inner + 2 * gn)
    norm = inner * (a.mamba.norm != "none")
    other = 3 * h + norm + a.mamba.conv_bias * (inner + 2 * gn) + a.mamba.proj_bias * (2 * inner + 2 * gn + h + d)
    return matmul, other


def flops(a, spec, seq_len: int) -> float:
    """The chunked scan's multiply-adds per token (``ssd``: C.B and the masked product with x over
    half a chunk on average, and each token's part of its chunk's state in and out), 2 x 3 FLOPs each."""
    q, h, p, n = a.mamba.chunk_size, a.mamba.num_heads, a.mamba.head_dim, a.mamba.state_size
    return 6 * (q / 2 * (a.mamba.n_groups * n + h * p) + 2 * h * p * n)


def decode_flops(a, spec, context: float) -> float:
    """A step's update and read of the state: 2 h p n multiply-adds."""
    return 2 * (2 * a.mamba.num_heads * a.mamba.head_dim * a.mamba.state_size)


def activations(cost, spec=None, context: str = "attn_context") -> dict:
    """in_proj's outputs (z, x, B, C, dt), the convolutions' outputs, and the chunked scan's
    float32 arrays of [chunk] per head and token (the decays' differences, their exponential, the
    masked decay, its products with C.B and dt: 6 counting the masks' where), the per-chunk states
    and the output; then the gated norm's (3 per feature, float32) and the out projection's input
    (``context``: its name)."""
    a, t = cost.config.arch, cost.t
    inner, gn, h = a.mamba.inner, a.mamba.n_groups * a.mamba.state_size, a.mamba.num_heads
    q = min(a.mamba.chunk_size, cost.seq_len)
    blh = (ax.BATCH, ax.LENGTH, ax.SSM_HEADS)
    per_chunk_state = h * a.mamba.head_dim * a.mamba.state_size / q  # a chunk's state, per token
    return {"mamba_in": t(2 * inner + 2 * gn + h, blh), "mamba_conv": t(inner + 2 * gn, blh),
            "ssm_decay": t(6 * h * q, blh, 4), "ssm_states": t(2 * per_chunk_state, blh, 4),
            "ssm_out": t(inner, blh), "ssm_norm": t(3 * inner, blh, 4), context: t(inner, blh)}


def cache_bytes(a, batch: int, length: int, nbytes: int) -> int:
    """The float32 state, its segment id, and each of three convolutions' last inputs."""
    h, gn = a.mamba.conv_kernel - 1, a.mamba.n_groups * a.mamba.state_size
    return batch * (4 * a.mamba.inner * a.mamba.state_size + 4 + h * ((a.mamba.inner + 2 * gn) * nbytes + 3 * 4))


@dataclasses.dataclass(frozen=True)
class MambaArch(SubRecord):
    """The Mamba2 mixers' settings (the mamba and attention+mamba layers): in_proj to z, x
    (num_heads x head_dim each), B, C (n_groups x state_size each) and dt (heads); x, B, C
    through a causal depthwise conv of conv_kernel taps (with bias: conv_bias) and SiLU; the
    selective scan in chunks of chunk_size tokens, dt = clamp(softplus(dt + dt_bias),
    time_step_limit); the output's gate and norm (``norm``: "gated" RMSNorm(y * silu(z)),
    Mamba2's; "before_gate" RMSNorm(y) * silu(z); "none" y * silu(z), Falcon-H1's
    mamba_rms_norm false); out_proj (biases: proj_bias)."""

    NAME: ClassVar[str] = "mamba"
    FEATURE: ClassVar[str] = "mamba2"
    OWNERS: ClassVar[tuple[str, ...]] = (MAMBA, ATTENTION_MAMBA)
    FLAT: ClassVar[dict[str, str]] = {
        "mamba_num_heads": "num_heads", "mamba_head_dim": "head_dim", "mamba_n_groups": "n_groups",
        "ssm_state_size": "state_size", "mamba_conv_kernel": "conv_kernel", "mamba_chunk_size": "chunk_size",
        "mamba_conv_bias": "conv_bias", "mamba_proj_bias": "proj_bias", "time_step_limit": "time_step_limit",
        "mamba_norm": "norm"}

    num_heads: int = 0
    head_dim: int = 64
    n_groups: int = 1
    state_size: int = 128
    conv_kernel: int = 4
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = feature(False, "mamba_proj_bias")
    time_step_limit: tuple[float, float] = feature((0.0, math.inf), "time_step_limit")
    norm: str = feature("gated", {"before_gate": "mamba_norm_before_gate", "none": "mamba_no_norm"})

    def __post_init__(self):
        if isinstance(self.time_step_limit, list):
            object.__setattr__(self, "time_step_limit", tuple(self.time_step_limit))

    @property
    def inner(self) -> int:
        """Features of a mamba layer's x (and z): heads x head_dim."""
        return self.num_heads * self.head_dim

    def check(self, arch) -> None:
        for name in ("mamba_num_heads", "mamba_head_dim", "mamba_n_groups", "ssm_state_size", "mamba_chunk_size"):
            value = getattr(self, self.FLAT[name])
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"layer_types has {MAMBA} layers: {name}={value!r} must be an integer >= 1")
        if not isinstance(self.conv_kernel, int) or self.conv_kernel < 2:
            raise ModelError(f"mamba_conv_kernel={self.conv_kernel!r} must be an integer >= 2 (the convolution's taps)")
        if self.num_heads % self.n_groups:
            raise ModelError(f"mamba_n_groups={self.n_groups} must divide mamba_num_heads={self.num_heads}")
        if self.norm not in ("gated", "before_gate", "none"):
            raise ModelError(f"mamba_norm={self.norm!r} is not one of gated, before_gate, none")
        limit = self.time_step_limit
        if (not isinstance(limit, tuple) or len(limit) != 2 or not all(isinstance(v, (int, float)) for v in limit)
                or not 0 <= limit[0] <= limit[1]):
            raise ModelError(f"time_step_limit={limit!r} must be two numbers 0 <= low <= high (dt's clamp)")


CONTEXT_PARALLEL = ("the scan linear in its initial state: each device scans its chunks from zero, the states passed "
                    "along the ring's chunks by ppermute (ring_ssd); the convolutions' taps as the short "
                    "convolution's")
MIXER = Mixer(MAMBA, (MAMBA,), _apply, params, flops, decode_flops, activations, cache_bytes=cache_bytes,
              context_parallel=CONTEXT_PARALLEL, records=(MambaArch,))


def _both(f, g, combine=lambda x, y: x + y):
    return lambda *args: combine(f(*args), g(*args))


# Falcon-H1's layers: attention's arrays and the mixer's beside them (its out projection's input as mamba_context)
ATTENTION_MAMBA_MIXER = Mixer(
    ATTENTION_MAMBA, (ATTENTION_MAMBA,), _both(attention.MIXER.apply, _apply),
    _both(attention.params, params, lambda x, y: (x[0] + y[0], x[1] + y[1])), _both(attention.flops, flops),
    _both(attention.decode_flops, decode_flops),
    lambda cost, spec=None: attention.activations(cost) | activations(cost, context="mamba_context"),
    attention.model_terms, _both(attention.cache_bytes, cache_bytes),
    f"attention's ({attention.CONTEXT_PARALLEL}) and the mamba mixer's ({CONTEXT_PARALLEL})", attention.check,
    (*attention.MIXER.records, MambaArch))
