"""Gated DeltaNet: Qwen3-Next's linear attention, a token mixer in place of attention on its
"linear_attention" layers.

Per value head a recurrent state follows the gated delta rule (``models/delta_rule.py``: token
by token for decoding, in chunks for training, over the ring under context parallelism).

The block (``GatedDeltaNet``): q, k [key heads, key_dim], v, z [value heads, value_dim] and
b, a [value heads] projected from the input; q, k and v each through a causal depthwise
convolution (``conv_mixer.causal_conv``) and SiLU; each key head serves value_heads / key_heads
consecutive value heads; the output RMS-normalised per head (one weight), times silu(z), then
projected out.

Packed rows: a segment starts with a zero state, and the convolution's taps see nothing across a
segment's start (segment ids; a segment occupies consecutive tokens). Decoding keeps each
layer's state, its segment id and the convolution's last w - 1 inputs in the "cache" collection.

Context parallelism: the states pass along the ring's chunks (``delta_rule.ring_gated_delta``);
the convolution's taps take the previous chunk's tail as LFM2's do (``ring_conv``); the sequence
is never gathered.
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
from shardzoo.models.conv_mixer import causal_conv, check_ring_chunk, ring_conv
from shardzoo.models.delta_rule import (
    gated_delta_chunked,
    gated_delta_step,
    l2norm,
    ring_gated_delta,
)
from shardzoo.models.features import feature
from shardzoo.models.layers import Linear, constrain, dtype_of, fused, fuses, linear_kw, positive
from shardzoo.sharding import axes as ax

LINEAR = "linear_attention"  # its name in layer_types
BLKD = (ax.BATCH, ax.LENGTH, ax.LINEAR_KEY_HEADS, ax.LINEAR_KEY_DIM)
BLVD = (ax.BATCH, ax.LENGTH, ax.LINEAR_HEADS, ax.LINEAR_VALUE_DIM)
STATE = (ax.BATCH, ax.LINEAR_HEADS, ax.LINEAR_KEY_DIM, ax.LINEAR_VALUE_DIM)


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
    and ``out``. A subclass with another decay swaps ``rule`` (Kimi's: ``models/kimi_delta.py``)."""

    config: object
    placement: object = None

    def rule(self, *args):
        """The chunked delta rule (``gated_delta_chunked``'s arguments and results)."""
        return gated_delta_chunked(*args)

    @nn.compact
    def __call__(self, x, segment_ids=None, decode: bool = False):
        a, e, placement = self.config.arch, self.config.execution, self.placement
        la = a.linear_attention
        nk, nv = la.num_key_heads, la.num_value_heads
        dk, dv = la.key_head_dim, la.value_head_dim
        kw, pdt = linear_kw(self.config), dtype_of(e.param_dtype)
        key_axes, value_axes = (ax.LINEAR_KEY_HEADS, ax.LINEAR_KEY_DIM), (ax.LINEAR_HEADS, ax.LINEAR_VALUE_DIM)
        pairs = [[Linear(shape, (ax.EMBED, *axes), name=n, **kw) for n in names]
                 for names, shape, axes in (("qk", (nk, dk), key_axes), ("vz", (nv, dv), value_axes),
                                            ("ba", (nv,), (ax.LINEAR_HEADS,)))]
        project = fused if fuses(e) else lambda lins, x: [lin(x) for lin in lins]
        (q, k), (v, z), (b, a_) = (project(p, x) for p in pairs)
        # q, k: [batch, length, key_heads, key_dim]; v, z: [batch, length, heads, value_dim]; b, a: [batch, length, heads]
        seg = self.segments(x, segment_ids, decode)
        q, k, v = self.conv_silu({"q": (q, BLKD), "k": (k, BLKD), "v": (v, BLVD)}, seg, decode, la.conv_kernel_dim)
        a_log = self.param("A_log", nn.with_logical_partitioning(_a_log_init, (ax.LINEAR_HEADS,)), (nv,), pdt)
        dt_bias = self.param("dt_bias", nn.with_logical_partitioning(nn.initializers.ones, (ax.LINEAR_HEADS,)),
                             (nv,), pdt)
        beta = jax.nn.sigmoid(b.astype(jnp.float32)) * (2.0 if la.allow_neg_eigval else 1.0)
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a_.astype(jnp.float32) + dt_bias.astype(jnp.float32))
        r = nv // nk  # each key head serves r consecutive value heads
        q = jnp.repeat(l2norm(q) * dk**-0.5, r, axis=2)  # [batch, length, heads, key_dim]
        k = jnp.repeat(l2norm(k), r, axis=2)
        out = self.delta(q, k, v, g, beta, seg, decode)
        out = constrain(out.astype(x.dtype), BLVD, placement)  # [batch, length, heads, value_dim]
        # the gated RMSNorm of each head (one weight for all heads): norm(out) * silu(z)
        scale = self.param("norm", nn.with_logical_partitioning(nn.initializers.ones, (ax.LINEAR_VALUE_DIM,)),
                           (dv,), pdt)
        y = checkpoint_name(constrain(gated_rms_norm(out, z, scale, la.norm_eps or a.rms_norm_eps), BLVD, placement), "attn_context")
        out = Linear((a.hidden_size,), (*value_axes, ax.EMBED), name="out", **kw)(y)
        return checkpoint_name(out, "attn_out")  # [batch, length, embed]: the mixer's output

    @staticmethod
    def segments(x, segment_ids, decode: bool):
        """The segment ids the rule and the taps read (decoding: ones where none are given)."""
        if decode:
            return jnp.ones(x.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        return segment_ids

    def conv_silu(self, named: dict, seg, decode: bool, width: int) -> list:
        """Each of ``named`` ({name: (x [batch, length, heads, dim], its logical axes)}) through its
        causal depthwise convolution of ``width`` taps (the parameter ``conv_<name>`` [width, heads,
        dim]) then SiLU; under context parallelism the taps read the previous chunk's tail
        (``ring_conv``); decoding reads and moves on the cache of its last width - 1 inputs."""
        a, placement = self.config.arch, self.placement
        ring = placement.ring_axes if placement is not None and not decode else ()
        pdt, w = dtype_of(self.config.execution.param_dtype), width
        if decode:
            cache = self._conv_cache({n: (y.shape, axes) for n, (y, axes) in named.items()}, w)
            prev = {n: (var.value.reshape(seg.shape[0], w - 1, -1), cache[1].value) for n, var in cache[0].items()}
        convolved, inputs = [], {}
        for n, (y, axes) in named.items():
            tap = self.param(f"conv_{n}", nn.with_logical_partitioning(
                nn.initializers.normal(a.initializer_range), (ax.CONV_WIDTH, *axes[2:])), (w, *y.shape[2:]), pdt)
            y = inputs[n] = constrain(y, axes, placement)
            flat, kernel = y.reshape(y.shape[:2] + (-1,)), tap.reshape(w, -1)
            if decode:
                out = causal_conv(flat, kernel, seg, *prev[n])
            elif ring and not self.is_initializing():
                out = ring_conv(flat, kernel, seg, placement)
            else:
                if ring:  # init runs the plain path; the length is checked when the program is built
                    check_ring_chunk(flat.shape[1], w, placement)
                out = causal_conv(flat, kernel, seg)
            convolved.append(jax.nn.silu(out).reshape(y.shape))
        if decode:
            _push(*cache, inputs, seg)
        return convolved

    def delta(self, q, k, v, g, beta, seg, decode: bool):
        """The rule (``self.rule``) over q, k [batch, length, heads, key_dim], v [batch, length,
        heads, value_dim]: in chunks, over the context-parallel ring, or from the cache while decoding."""
        placement, chunk = self.placement, self.config.execution.linear_attention_chunk
        if decode:
            return self._recurrent(q, k, v, g, beta, seg, chunk)
        if placement is not None and placement.ring_axes and not self.is_initializing():
            return ring_gated_delta(q, k, v, g, beta, seg, chunk, placement, self.rule)
        return self.rule(q, k, v, g, beta, chunk, seg)[0]

    def _cached(self, name, shape, axes, dtype):
        return self.variable("cache", name, nn.with_logical_partitioning(jnp.zeros, axes), shape, dtype)

    def _conv_cache(self, shapes: dict, w: int):
        """The cache variables of the convolution's last w - 1 inputs (``shapes``: {name: (input
        shape, its logical axes)}) and their segment ids."""
        dt = dtype_of(self.config.execution.dtype)
        inputs = {n: self._cached(f"conv_{n}", (shape[0], w - 1) + shape[2:], (ax.BATCH, ax.CONV_WIDTH, *axes[2:]), dt)
                  for n, (shape, axes) in shapes.items()}
        batch = next(iter(shapes.values()))[0][0]
        return inputs, self._cached("conv_segment_ids", (batch, w - 1), (ax.BATCH, ax.CONV_WIDTH), jnp.int32)

    def _recurrent(self, q, k, v, g, beta, seg, chunk):
        """Decoding: the rule from the cached state (a prompt in chunks, a token by the step),
        and the cache moved on (state, its segment, the convolution's last inputs)."""
        batch, _, nv, dk = q.shape
        state = self._cached("recurrent_state", (batch, nv, dk, v.shape[-1]), STATE, jnp.float32)
        state_seg = self._cached("state_segment_id", (batch,), (ax.BATCH,), jnp.int32)
        if q.shape[1] == 1:
            out, new = gated_delta_step(q, k, v, g, beta, seg, state.value, state_seg.value)
        else:
            out, new = self.rule(q, k, v, g, beta, chunk, seg, state.value, state_seg.value)
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
    x value_head_dim, the causal convolution's conv_kernel_dim taps (Qwen3-Next's linear_* fields);
    OLMo hybrid's rate doubled (beta in [0, 2]: ``allow_neg_eigval``) and the gated norm's own
    epsilon (``norm_eps``; None: rms_norm_eps)."""

    NAME: ClassVar[str] = "linear_attention"
    FEATURE: ClassVar[str] = "gated_deltanet"
    OWNERS: ClassVar[tuple[str, ...]] = (LINEAR,)
    SIZES: ClassVar[tuple[str, ...]] = ("num_value_heads", "num_key_heads", "key_head_dim", "value_head_dim",
                                        "conv_kernel_dim")
    FLAT: ClassVar[dict[str, str]] = {f"linear_{n}": n for n in (*SIZES, "allow_neg_eigval", "norm_eps")}

    num_value_heads: int | None = None
    num_key_heads: int | None = None
    key_head_dim: int | None = None
    value_head_dim: int | None = None
    conv_kernel_dim: int | None = None
    allow_neg_eigval: bool = feature(False, "delta_negative_eigenvalues")
    norm_eps: float | None = feature(None, "delta_norm_eps")

    def check(self, arch) -> None:
        if self.norm_eps is not None and not positive(self.norm_eps):
            raise ModelError(f"linear_norm_eps={self.norm_eps!r} must be a finite number > 0 (or null: rms_norm_eps)")
        for name in self.SIZES:
            flat, value = f"linear_{name}", getattr(self, name)
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
