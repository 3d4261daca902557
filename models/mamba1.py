"""Mamba1's selective state-space mixer: the token mixer of the "mamba1" layers (Mamba, Falcon-Mamba,
Jamba's mamba layers), in attention's place.

``Mamba1Mixer``: ``x, z = in_proj(h)`` [inner channels each]; x through a causal depthwise
convolution (with bias) and SiLU; ``dt, B, C = x_proj(x)`` (dt of ``dt_rank`` features, B and C
of ``state_size``; Falcon-Mamba RMS-normalises each of the three, without weights);
``dt = softplus(dt_proj(dt) + dt_bias)`` per channel; ``A = -exp(A_log)`` [inner, state]: unlike
Mamba2's one decay per head, each channel has its own decay per state entry. Per channel c the
state s [state] runs

    s_t = exp(dt_t[c] A[c]) * s_{t-1} + dt_t[c] x_t[c] B_t,    y_t[c] = s_t . C_t + D[c] x_t[c],

then ``y * silu(z)`` and ``out_proj``. The channels are named ``ssm_heads`` (tensor-parallel
shards them, as Mamba2's heads: a channel is a head of one feature).

Training computes the recurrence in chunks of ``linear_attention_chunk`` tokens
(``selective_scan``): within a chunk an associative scan of the affine maps ``s -> a s + u``,
across chunks the state carried by ``lax.scan`` whose step is rematerialised (the backward keeps
one state per chunk, not the [length, inner, state] of every token). ``selective_steps`` is the
token-by-token recurrence (decoding, and the tests' reference). Packed segments reset the state
at a segment's start (a = 0 there); a left-padded prompt's padding is segment 0.

Decoding keeps, per layer, the convolution's last w - 1 inputs and their segment ids, and the
state [batch, inner, state] (float32) with the segment id it belongs to.

Context parallelism (tokens in the ring's zig-zag order, ``models/ring_attention.py``): the
convolution passes its w - 1 input tails (``ring_conv``); the scan is affine in its initial state:
each device scans its two chunks from zero (their final states and their decays
``prod exp(dt A)``, 0 across a segment start), the entering states pass along the 2N chunks by
``ppermute`` (2N - 1 rounds), then each chunk is scanned again from its entering state. Only
states [batch, inner, state] move; the sequence is never gathered.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from shardzoo.models import ModelError
from shardzoo.models.component import Mixer, SubRecord
from shardzoo.models.conv_mixer import causal_conv, ring_conv
from shardzoo.models.features import feature
from shardzoo.models.kimi_delta import _dt_bias_init
from shardzoo.models.layers import Linear, constrain, dtype_of, linear_kw
from shardzoo.models.ring_attention import other_axes, spec_of
from shardzoo.sharding import axes as ax

MAMBA1 = "mamba1"  # its name in layer_types
BLD = (ax.BATCH, ax.LENGTH, ax.SSM_HEADS)  # x, z, dt, y: [batch, length, inner]
BLN = (ax.BATCH, ax.LENGTH, ax.SSM_STATE)  # B, C
STATE = (ax.BATCH, ax.SSM_HEADS, ax.SSM_STATE)


# ------------------------------------------------------------------------------ the scan
def _prepare(dt, seg, state, state_seg, b, d, n):
    """Defaults (one segment, a zero state in it) and each token's 'same segment as before' [b, L]."""
    if seg is None:
        seg = jnp.ones(dt.shape[:2], jnp.int32)
    if state_seg is None:
        state_seg = seg[:, 0]
    if state is None:
        state = jnp.zeros((b, d, n), jnp.float32)
    before = jnp.concatenate([state_seg[:, None].astype(seg.dtype), seg[:, :-1]], axis=1)
    return (seg == before).astype(jnp.float32), state.astype(jnp.float32)


def selective_scan(x, dt, A, B, C, chunk: int, seg=None, state=None, state_seg=None):
    """The chunked scan. x, dt [batch, length, inner] (dt after softplus); A [inner, state]
    (negative); B, C [batch, length, state]; ``seg`` [batch, length] segment ids (None: one
    segment); ``state`` [batch, inner, state] before the first token (None: zeros) and
    ``state_seg`` [batch] its segment. Float32. Returns (y [batch, length, inner] without the D
    skip, the final state)."""
    b, length, d = x.shape
    n = A.shape[1]
    f32 = jnp.float32
    same, state = _prepare(dt, seg, state, state_seg, b, d, n)
    x, dt, B, C, A = (t.astype(f32) for t in (x, dt, B, C, A))
    pad = (-length) % chunk
    if pad:  # a padded tail: dt 0 and x 0 (the state passes unchanged)
        x, dt, B, C = (jnp.pad(t, ((0, 0), (0, pad), (0, 0))) for t in (x, dt, B, C))
        same = jnp.pad(same, ((0, 0), (0, pad)), constant_values=1.0)
    nc = (length + pad) // chunk

    def chunks(t):  # [batch, nc * chunk, ...] -> [nc, batch, chunk, ...]
        return jnp.moveaxis(t.reshape((b, nc, chunk) + t.shape[2:]), 1, 0)

    @jax.checkpoint
    def step(s, inputs):
        xc, dtc, bc, cc, sc = inputs  # [b, q, d], [b, q, d], [b, q, n], [b, q, n], [b, q]
        a = jnp.exp(dtc[..., None] * A) * sc[..., None, None]  # [b, q, d, n]
        u = (dtc * xc)[..., None] * bc[:, :, None, :]
        a_cum, u_cum = jax.lax.associative_scan(lambda e, f: (e[0] * f[0], f[0] * e[1] + f[1]), (a, u), axis=1)
        states = a_cum * s[:, None] + u_cum  # [b, q, d, n]: the state after each token
        return states[:, -1], jnp.einsum("bqdn,bqn->bqd", states, cc)

    # (+ 0 x a chunk's input: inside a shard_map the carry varies over the devices as the inputs do)
    s0 = state + 0.0 * x[:, 0, :, None] * B[:, 0, None, :]
    final, y = jax.lax.scan(step, s0, tuple(map(chunks, (x, dt, B, C, same))))
    return jnp.moveaxis(y, 0, 1).reshape(b, nc * chunk, d)[:, :length], final


def selective_steps(x, dt, A, B, C, seg=None, state=None, state_seg=None):
    """The same recurrence token by token (decoding; the reference of ``selective_scan``); same
    arguments and results."""
    b, _, d = x.shape
    same, state = _prepare(dt, seg, state, state_seg, b, d, A.shape[1])
    A = A.astype(jnp.float32)

    def step(s, inputs):
        xt, dtt, bt, ct, st = inputs  # [b, d], [b, d], [b, n], [b, n], [b]
        s = st[:, None, None] * jnp.exp(dtt[..., None] * A) * s + (dtt * xt)[..., None] * bt[:, None, :]
        return s, jnp.einsum("bdn,bn->bd", s, ct)

    inputs = tuple(jnp.moveaxis(t.astype(jnp.float32), 1, 0) for t in (x, dt, B, C, same))
    final, y = jax.lax.scan(step, state, inputs)
    return jnp.moveaxis(y, 0, 1), final


# ------------------------------------------------------------------- context parallelism
def _ring_local(x, dt, A, B, C, seg, *, chunk, axes, n):
    """Per device: its two ring chunks (d and 2N-1-d) scanned from zero, the states passed along
    the 2N chunks, then each chunk scanned from its entering state."""
    c = x.shape[1] // 2
    d = jax.lax.axis_index(axes)
    forward = [(i, i + 1) for i in range(n - 1)]
    backward = [(i + 1, i) for i in range(n - 1)]

    def from_previous(first, second, fill):
        """Chunk i's value to chunk i + 1 (the first chunks forward, the second backward, device
        N - 1's second chunk from its own first); chunk 0 gets ``fill``."""
        p1 = jnp.where(d == 0, fill, jax.lax.ppermute(first, axes, forward))
        p2 = jnp.where(d == n - 1, first, jax.lax.ppermute(second, axes, backward))
        return p1, p2

    parts = [tuple(t[:, i * c:(i + 1) * c] for t in (x, dt, B, C, seg)) for i in range(2)]
    prev_seg = from_previous(parts[0][4][:, -1], parts[1][4][:, -1], parts[0][4][:, 0])
    locs, decays = [], []
    for (xi, dti, bi, ci, si), sp in zip(parts, prev_seg, strict=True):
        locs.append(selective_scan(xi, dti, A, bi, ci, chunk, si, None, sp)[1])
        through = jnp.all(si == sp[:, None], axis=1).astype(jnp.float32)  # [b]: no segment starts inside
        total = jnp.sum(dti.astype(jnp.float32), axis=1)[..., None] * A.astype(jnp.float32)  # [b, d, n]
        decays.append(jnp.exp(total) * through[:, None, None])
    zero = jnp.zeros_like(locs[0])
    s1 = s2 = zero  # the states entering the two chunks, exact after 2N - 1 rounds
    for _ in range(2 * n - 1):
        s1, s2 = from_previous(decays[0] * s1 + locs[0], decays[1] * s2 + locs[1], zero)
    ys = [selective_scan(xi, dti, A, bi, ci, chunk, si, s_in, sp)[0]
          for (xi, dti, bi, ci, si), sp, s_in in zip(parts, prev_seg, (s1, s2), strict=True)]
    return jnp.concatenate(ys, axis=1)


def ring_selective_scan(x, dt, A, B, C, seg, chunk: int, placement):
    """``selective_scan`` (its outputs) of length-sharded, zig-zag ordered inputs over the ring."""
    axes = placement.ring_axes
    n = placement.size(axes)
    batch = other_axes(placement, ax.BATCH, (x.shape[0],), axes)
    channels = other_axes(placement, ax.SSM_HEADS, (x.shape[2],), axes + batch)
    if seg is None:
        seg = jnp.ones(x.shape[:2], jnp.int32)
    xs, ns = spec_of(batch, axes, channels), spec_of(batch, axes, None)
    fn = lambda *a: _ring_local(*a, chunk=chunk, axes=axes, n=n)  # noqa: E731
    return jax.shard_map(fn, mesh=placement.mesh, in_specs=(xs, xs, spec_of(channels, None), ns, ns,
                                                            spec_of(batch, axes)), out_specs=xs)(x, dt, A, B, C, seg)


# --------------------------------------------------------------------------------- the mixer
def weightless_rms_norm(t, eps: float):
    """RMS-normalised over the last axis in float32, no weight (Falcon-Mamba's B, C and dt)."""
    t32 = t.astype(jnp.float32)
    return (t32 * jax.lax.rsqrt(jnp.mean(t32 * t32, axis=-1, keepdims=True) + eps)).astype(t.dtype)


def _a_log_init(key, shape, dtype):
    """log(1..state) for every channel (S4D-real, transformers' initialisation)."""
    return jnp.broadcast_to(jnp.log(jnp.arange(1, shape[1] + 1, dtype=jnp.float32)), shape).astype(dtype)


class Mamba1Mixer(nn.Module):
    """Mamba1's mixer (see the module doc). Parameters: ``in_x``, ``in_z`` [embed, inner]
    (transformers' in_proj in two), ``conv`` [conv_width, inner] (and ``conv_bias``), ``x_dt``
    [inner, dt_rank], ``x_b``, ``x_c`` [inner, state] (its x_proj in three), ``dt`` [dt_rank,
    inner] with ``dt_bias`` (dt_proj), ``A_log`` [inner, state], ``D`` [inner], ``out``; Jamba's
    ``dt_norm``, ``b_norm``, ``c_norm``."""

    config: object
    placement: object = None

    @nn.compact
    def __call__(self, h, segment_ids=None, decode: bool = False):
        a, e, placement = self.config.arch, self.config.execution, self.placement
        m = a.mamba1
        d, n, r = m.intermediate_size, m.state_size, m.dt_rank
        kw, pdt = linear_kw(self.config), dtype_of(e.param_dtype)
        x = Linear((d,), (ax.EMBED, ax.SSM_HEADS), m.proj_bias, name="in_x", **kw)(h)  # [batch, length, inner]
        z = Linear((d,), (ax.EMBED, ax.SSM_HEADS), m.proj_bias, name="in_z", **kw)(h)
        ring = placement.ring_axes if placement is not None and not decode and not self.is_initializing() else ()
        seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
        if decode and seg is None:
            seg = jnp.ones(h.shape[:2], jnp.int32)
        x = self._conv(constrain(x, BLD, placement), seg, decode, ring)
        dt = Linear((r,), (ax.SSM_HEADS, ax.SSM_RANK), name="x_dt", **kw)(x)  # [batch, length, dt_rank]
        B = Linear((n,), (ax.SSM_HEADS, ax.SSM_STATE), name="x_b", **kw)(x)  # [batch, length, state]
        C = Linear((n,), (ax.SSM_HEADS, ax.SSM_STATE), name="x_c", **kw)(x)
        if m.bcdt_rms_eps is not None:  # Falcon-Mamba's weightless norms (Jamba's with weights)
            dt, B, C = (weightless_rms_norm(t, m.bcdt_rms_eps) for t in (dt, B, C))
            if m.bcdt_norm_weights:
                dt, B, C = (t * self.param(f"{k}_norm", nn.with_logical_partitioning(nn.initializers.ones, (axis,)),
                                           (t.shape[-1],), pdt).astype(t.dtype)
                            for t, k, axis in ((dt, "dt", ax.SSM_RANK), (B, "b", ax.SSM_STATE), (C, "c", ax.SSM_STATE)))
        B, C = constrain(B, BLN, placement), constrain(C, BLN, placement)
        dt = Linear((d,), (ax.SSM_RANK, ax.SSM_HEADS), name="dt", **kw)(dt)  # [batch, length, inner]
        dt_bias = self.param("dt_bias", nn.with_logical_partitioning(_dt_bias_init, (ax.SSM_HEADS,)), (d,), pdt)
        A_log = self.param("A_log", nn.with_logical_partitioning(_a_log_init, (ax.SSM_HEADS, ax.SSM_STATE)), (d, n),
                           pdt)
        D = self.param("D", nn.with_logical_partitioning(nn.initializers.ones, (ax.SSM_HEADS,)), (d,), pdt)
        dt = constrain(jax.nn.softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32)), BLD, placement)
        A = -jnp.exp(A_log.astype(jnp.float32))
        if decode:
            y = self._continue(x, dt, A, B, C, seg)
        elif ring:
            y = ring_selective_scan(x, dt, A, B, C, seg, e.linear_attention_chunk, placement)
        else:
            y, _ = selective_scan(x, dt, A, B, C, e.linear_attention_chunk, seg)
        y = (y + x.astype(jnp.float32) * D.astype(jnp.float32)) * jax.nn.silu(z.astype(jnp.float32))
        y = checkpoint_name(constrain(y.astype(h.dtype), BLD, placement), "attn_context")
        out = Linear((a.hidden_size,), (ax.SSM_HEADS, ax.EMBED), m.proj_bias, name="out", **kw)(y)
        return checkpoint_name(out, "attn_out")  # [batch, length, embed]

    def _conv(self, x, seg, decode, ring):
        """SiLU(causal depthwise conv + bias) of x [batch, length, inner]; decoding continues the
        cached inputs; under context parallelism the ring passes the tails."""
        a = self.config.arch
        w, d, pdt = a.mamba1.conv_kernel, x.shape[2], dtype_of(self.config.execution.param_dtype)
        kernel = self.param("conv", nn.with_logical_partitioning(
            nn.initializers.normal(a.initializer_range), (ax.CONV_WIDTH, ax.SSM_HEADS)), (w, d), pdt)
        if decode:
            state = self.variable("cache", "conv_state", nn.with_logical_partitioning(
                jnp.zeros, (ax.BATCH, ax.CONV_WIDTH, ax.SSM_HEADS)), (x.shape[0], w - 1, d), x.dtype)
            state_seg = self.variable("cache", "conv_segment_ids", nn.with_logical_partitioning(
                jnp.zeros, (ax.BATCH, ax.CONV_WIDTH)), (x.shape[0], w - 1), jnp.int32)
            out = causal_conv(x, kernel, seg, state.value, state_seg.value)
            state.value = jnp.concatenate([state.value, x], axis=1)[:, 1 - w:]
            state_seg.value = jnp.concatenate([state_seg.value, seg], axis=1)[:, 1 - w:]
        elif ring:
            out = ring_conv(x, kernel, seg, self.placement, ax.SSM_HEADS)
        else:
            out = causal_conv(x, kernel, seg)
        if a.mamba1.conv_bias:
            bias = self.param("conv_bias", nn.with_logical_partitioning(nn.initializers.zeros, (ax.SSM_HEADS,)), (d,),
                              pdt)
            out = out + bias.astype(out.dtype)
        return jax.nn.silu(out)

    def _continue(self, x, dt, A, B, C, seg):
        """The scan continuing the cached state (a prompt in chunks, a token by the recurrence)."""
        batch, d, n = x.shape[0], A.shape[0], A.shape[1]
        state = self.variable("cache", "ssm_state", nn.with_logical_partitioning(jnp.zeros, STATE), (batch, d, n),
                              jnp.float32)
        state_seg = self.variable("cache", "ssm_segment_ids", nn.with_logical_partitioning(jnp.zeros, (ax.BATCH,)),
                                  (batch,), jnp.int32)
        if x.shape[1] == 1:
            y, final = selective_steps(x, dt, A, B, C, seg, state.value, state_seg.value)
        else:
            y, final = selective_scan(x, dt, A, B, C, self.config.execution.linear_attention_chunk, seg,
                                      state.value, state_seg.value)
        state.value, state_seg.value = final, seg[:, -1]
        return y


# ------------------------------------------------------------------------------ the component
@dataclasses.dataclass(frozen=True)
class Mamba1Arch(SubRecord):
    """The Mamba1 mixers' settings (the mamba1 layers): in_proj to x and z (intermediate_size
    channels each, biases: proj_bias), a causal depthwise conv of conv_kernel taps on x (with bias:
    conv_bias), x_proj to dt (dt_rank), B and C (state_size), dt_proj back to the channels; with
    ``bcdt_rms_eps`` (Falcon-Mamba's mixer_rms_eps) dt, B and C RMS-normalised without weights
    (``bcdt_norm_weights``: with, Jamba's dt_layernorm, b_layernorm, c_layernorm)."""

    NAME: ClassVar[str] = "mamba1"
    FEATURE: ClassVar[str] = "mamba1"
    OWNERS: ClassVar[tuple[str, ...]] = (MAMBA1,)
    FLAT: ClassVar[dict[str, str]] = {f"mamba1_{k}": k for k in (
        "intermediate_size", "state_size", "conv_kernel", "dt_rank", "conv_bias", "proj_bias", "bcdt_rms_eps",
        "bcdt_norm_weights")}

    intermediate_size: int = 0
    state_size: int = 16
    conv_kernel: int = 4
    dt_rank: int = 0
    conv_bias: bool = True
    proj_bias: bool = False
    bcdt_rms_eps: float | None = feature(None, "mamba1_bcdt_norm")
    bcdt_norm_weights: bool = feature(False, "mamba1_bcdt_norm_weights")  # those norms with weights (Jamba)

    def check(self, arch) -> None:
        for name in ("intermediate_size", "state_size", "dt_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"layer_types has {MAMBA1} layers: mamba1_{name}={value!r} must be an integer >= 1")
        if not isinstance(self.conv_kernel, int) or self.conv_kernel < 2:
            raise ModelError(f"mamba1_conv_kernel={self.conv_kernel!r} must be an integer >= 2 (the convolution's taps)")
        eps = self.bcdt_rms_eps
        if eps is not None and (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0):
            raise ModelError(f"mamba1_bcdt_rms_eps={eps!r} must be a number > 0 (or null: no norms on B, C, dt)")
        if self.bcdt_norm_weights and eps is None:
            raise ModelError("mamba1_bcdt_norm_weights=true weighs the norms of dt, B and C: set mamba1_bcdt_rms_eps")


def _apply(block, h, positions, segment_ids):
    """The mixer of the normed input ``h`` (its path: ``mamba``)."""
    return Mamba1Mixer(block.config, block.placement, name="mamba")(h, segment_ids, block.decode)


def params(a) -> tuple[int, int]:
    """(in_proj, x_proj, dt_proj, out_proj and the convolution's taps; dt_bias, A_log, D, the
    biases, the norms' weights)."""
    m, e = a.mamba1, a.hidden_size
    d, n, r = m.intermediate_size, m.state_size, m.dt_rank
    matmul = 2 * e * d + d * (r + 2 * n) + r * d + d * e + m.conv_kernel * d
    return matmul, d + d * n + d + m.conv_bias * d + m.proj_bias * (2 * d + e) + m.bcdt_norm_weights * (r + 2 * n)


def flops(a, spec, seq_len: int) -> float:
    """Per token and (channel, state) entry: the decay and input terms, the associative scan's
    two combines, the entering state and the output (6 multiply-adds), 2 x 3 FLOPs each."""
    return 6 * 6 * a.mamba1.intermediate_size * a.mamba1.state_size


def decode_flops(a, spec, context: float) -> float:
    """A step's decay, update and read of the state: 3 multiply-adds per (channel, state) entry."""
    return 2 * 3 * a.mamba1.intermediate_size * a.mamba1.state_size


def activations(cost, spec=None) -> dict:
    """in_proj's outputs (x, z), the convolution's output and masks, x_proj's (dt, B, C), dt after
    softplus (float32), one state per chunk (float32), the scan's output and the gated output
    (float32), the out projection's input."""
    a, t, chunk = cost.config.arch, cost.t, cost.config.execution.linear_attention_chunk
    m = a.mamba1
    d, n = m.intermediate_size, m.state_size
    bl = (ax.BATCH, ax.LENGTH, ax.SSM_HEADS)
    q = min(chunk, cost.seq_len)
    return {"mamba_in": t(2 * d, bl), "mamba_conv": t(d, bl), "conv_masks": t(m.conv_kernel, bl[:2], 4),
            "mamba_x_proj": t(m.dt_rank + 2 * n, bl[:2]), "mamba_dt": t(d, bl, 4),
            "ssm_states": t(d * n / q, bl, 4),
 "ssm_out": t(2 * d, bl, 4),
            "attn_context": t(d, bl)}


def model_terms(cost) -> dict:
    """A chunk's scan rematerialised in the backward pass, one layer at a time (its decays,
    inputs, prefix products and states, the associative scan's levels, and their cotangents:
    about 18 floats per channel, state entry and token of one chunk, as XLA's CPU step of
    mamba-tiny keeps)."""
    m, q = cost.config.arch.mamba1, min(cost.config.execution.linear_attention_chunk, cost.seq_len)
    return {"ssm_scan": cost.t(18 * m.intermediate_size * m.state_size * q / cost.seq_len,
                               (ax.BATCH, ax.LENGTH, ax.SSM_HEADS), 4)}


def cache_bytes(a, batch: int, length: int, nbytes: int) -> int:
    """The float32 state, its segment id, and the convolution's last inputs with theirs."""
    m = a.mamba1
    return batch * (4 * m.intermediate_size * m.state_size + 4 + (m.conv_kernel - 1) * (m.intermediate_size * nbytes
                                                                                         + 4))


CONTEXT_PARALLEL = ("the scan affine in its initial state: each device scans its chunks from zero, the states passed "
                    "along the ring's chunks by ppermute, each chunk scanned again from its entering state "
                    "(ring_selective_scan); the convolution's taps as the short convolution's")
MIXER = Mixer(MAMBA1, (MAMBA1,), _apply, params, flops, decode_flops, activations, model_terms, cache_bytes,
              context_parallel=CONTEXT_PARALLEL, records=(Mamba1Arch,))
