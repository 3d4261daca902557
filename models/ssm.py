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

The recurrence runs in chunks for training (``ssd``, the SSD form), token by token when decoding
(``ssd_steps``), and over the ring under context parallelism (``ring_ssd``): ``models/ssm_scan.py``.
Packed segments (segment ids) reset the state at a segment's start; a left-padded prompt's
padding is segment 0.

Decoding keeps, per mamba layer, the convolutions' last w - 1 inputs and their segment ids, and
the state [batch, ssm_heads, ssm_head_dim, ssm_state] with the segment id it belongs to.

Context parallelism: the convolutions pass their w - 1 input tails as ``ring_conv`` does, and the
scan's states pass along the ring's chunks (``ring_ssd``); the sequence is never gathered.
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
from shardzoo.models.ssm_scan import ring_ssd, ssd, ssd_steps
from shardzoo.sharding import axes as ax

MAMBA = "mamba"  # its name in layer_types
# attention and a Mamba2 mixer side by side on one norm, their outputs summed (Falcon-H1, whose
# transformers config calls every layer "hybrid"): x + attn(norm(x)) + mamba(norm(x)), then the MLP
ATTENTION_MAMBA = "attention+mamba"
BLHP = (ax.BATCH, ax.LENGTH, ax.SSM_HEADS, ax.SSM_HEAD_DIM)
BLGN = (ax.BATCH, ax.LENGTH, ax.SSM_GROUPS, ax.SSM_STATE)
STATE = (ax.BATCH, ax.SSM_HEADS, ax.SSM_HEAD_DIM, ax.SSM_STATE)


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
