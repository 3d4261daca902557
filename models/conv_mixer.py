"""The gated short convolution: LFM2's token mixer in place of attention on its "conv" layers.

``ShortConv``: ``b, c, x = in_proj(h)`` (each ``hidden_size`` wide), ``y = c * conv(b * x)``,
``out_proj(y)``, where ``conv`` is a causal depthwise convolution of ``conv_kernel`` taps: the
output at token t mixes the inputs at t - (w - 1) ... t, channel by channel (transformers'
``Lfm2ShortConv`` slow path). Taps across a packed segment's start see nothing (segment ids; a
left-padded prompt's padding is segment 0), as transformers zeroes padded inputs.

Decoding keeps each conv layer's last ``w - 1`` inputs (and their segment ids) in the "cache"
collection, [batch, conv_width, conv_channels]: a prefill and every step continue the row.

Context parallelism (``length`` on the ring's mesh axes; tokens in the ring's zig-zag order,
``models/ring_attention.py``): device d holds chunks d and 2N-1-d of each row. The chunks' first
w - 1 taps need the previous chunk's last w - 1 inputs: chunk d's come from device d - 1 (its
first chunk), chunk 2N-1-d's from device d + 1 (its second chunk), except on device N - 1,
whose second chunk (N) follows its own first (N - 1). Two ``ppermute``s of w - 1 tokens per
array a layer; the sequence is never gathered.
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
from shardzoo.models.features import feature
from shardzoo.models.layers import Linear, constrain, dtype_of, fused, fuses, linear_kw
from shardzoo.models.ring_attention import other_axes, spec_of
from shardzoo.sharding import axes as ax

CONV = "conv"  # its name in layer_types
BLC = (ax.BATCH, ax.LENGTH, ax.CONV_CHANNELS)


def causal_conv(x, kernel, seg=None, prev=None, prev_seg=None):
    """Causal depthwise convolution: ``out[t] = sum_k kernel[k] * x[t - (w - 1) + k]``.

    x: [batch, length, channels]; kernel: [w, channels]; ``prev`` [batch, w - 1, channels]: the
    inputs before the first token (zeros when None). With segment ids ``seg`` [batch, length]
    (and ``prev_seg`` [batch, w - 1], the previous inputs'), a tap from another segment counts 0.
    Computed in float32; the backward pass keeps only the inputs and one 0/1 per tap and token.
    """
    w, length = kernel.shape[0], x.shape[1]
    if prev is None:
        prev = jnp.zeros(x.shape[:1] + (w - 1,) + x.shape[2:], x.dtype)
    full = jnp.concatenate([prev.astype(x.dtype), x], axis=1)  # [batch, w - 1 + length, channels]
    if seg is None:
        masks = jnp.ones((x.shape[0], length, w), jnp.float32)
    else:
        if prev_seg is None:
            prev_seg = jnp.zeros(seg.shape[:1] + (w - 1,), seg.dtype)
        full_seg = jnp.concatenate([prev_seg.astype(seg.dtype), seg], axis=1)
        masks = jnp.stack([full_seg[:, k:k + length] == seg for k in range(w)], axis=-1).astype(jnp.float32)
    return _taps(full, kernel, jax.lax.stop_gradient(masks)).astype(x.dtype)  # [batch, length, channels]


@jax.custom_vjp
def _taps(full, kernel, masks):
    """``out[b, t] = sum_k kernel[k] * full[b, t + k] * masks[b, t, k]``, float32.
    full: [batch, w - 1 + length, channels]; masks: [batch, length, w] (0/1, no gradient)."""
    w, length = kernel.shape[0], masks.shape[1]
    f32 = full.astype(jnp.float32)
    return sum(f32[:, k:k + length] * masks[..., k:k + 1] * kernel[k].astype(jnp.float32) for k in range(w))


def _taps_fwd(full, kernel, masks):
    return _taps(full, kernel, masks), (full, kernel, masks)


def _taps_bwd(res, g):
    full, kernel, masks = res
    w, length = kernel.shape[0], masks.shape[1]
    f32 = full.astype(jnp.float32)
    g_kernel = jnp.stack([jnp.sum(g * f32[:, k:k + length] * masks[..., k:k + 1], axis=(0, 1)) for k in range(w)])
    g_full = sum(jnp.pad(g * masks[..., k:k + 1] * kernel[k].astype(jnp.float32), ((0, 0), (k, w - 1 - k), (0, 0)))
                 for k in range(w))
    return g_full.astype(full.dtype), g_kernel.astype(kernel.dtype), jnp.zeros_like(masks)


_taps.defvjp(_taps_fwd, _taps_bwd)


def check_ring_chunk(length: int, width: int, placement) -> None:
    """Each of the ring's 2N chunks must hold the w - 1 inputs the next chunk's taps need."""
    n = placement.size(placement.ring_axes)
    if length // (2 * n) < width - 1:
        raise ModelError(f"context parallelism cuts each row of {length} tokens into {2 * n} chunks of "
                         f"{length // (2 * n)}; the short convolution (conv_kernel={width}) needs {width - 1} "
                         "tokens of the previous chunk: use a longer sequence or a smaller context axis")


def _ring_local(x, kernel, seg, *, axes, n, rows):
    """Per device: x [b, 2C, channels] (chunks d and 2N-1-d), each chunk's taps fed the previous
    chunk's last w - 1 inputs by ppermute (see the module doc)."""
    h, c = kernel.shape[0] - 1, x.shape[1] // 2
    d = jax.lax.axis_index(axes)
    # the taps varying as the inputs do (over the ring and the batch's axes ``rows``), so their
    # cotangent (the custom backward's, per device) is summed over the devices by this cast's transpose
    kernel = jax.lax.pcast(kernel, rows + axes, to="varying")
    forward = [(i, i + 1) for i in range(n - 1)]  # chunk i's tail to chunk i + 1 (device 0 gets zeros)
    backward = [(i + 1, i) for i in range(n - 1)]  # chunk 2N-1-(i+1)'s tail to chunk 2N-1-i

    def tails(y):
        first, second = y[:, :c], y[:, c:]
        own = first[:, c - h:]
        prev1 = jax.lax.ppermute(own, axes, forward)
        prev2 = jnp.where(d == n - 1, own, jax.lax.ppermute(second[:, c - h:], axes, backward))
        return (first, second), (prev1, prev2)

    (x1, x2), (p1, p2) = tails(x)
    if seg is None:
        s1 = s2 = q1 = q2 = None
    else:
        (s1, s2), (q1, q2) = tails(seg)
    return jnp.concatenate([causal_conv(x1, kernel, s1, p1, q1), causal_conv(x2, kernel, s2, p2, q2)], axis=1)


def ring_conv(x, kernel, seg, placement, channels_name: str = ax.CONV_CHANNELS):
    """``causal_conv`` of length-sharded, zig-zag ordered ``x`` [batch, length, channels] over
    the placement's ring (``models/ring_attention.py``'s order), the kernel [w, channels];
    ``channels_name``: the channels' logical axis (a mamba layer's flattened heads or groups)."""
    axes = placement.ring_axes
    n = placement.size(axes)
    check_ring_chunk(x.shape[1], kernel.shape[0], placement)
    batch = other_axes(placement, ax.BATCH, (x.shape[0],), axes)
    channels = other_axes(placement, channels_name, (x.shape[2],), axes + batch)
    xs, ks = spec_of(batch, axes, channels), spec_of(None, channels)
    fn = lambda x, k, s: _ring_local(x, k, s, axes=axes, n=n, rows=batch)  # noqa: E731
    if seg is None:
        return jax.shard_map(lambda x, k: fn(x, k, None), mesh=placement.mesh, in_specs=(xs, ks),
                             out_specs=xs)(x, kernel)
    return jax.shard_map(fn, mesh=placement.mesh, in_specs=(xs, ks, spec_of(batch, axes)), out_specs=xs)(
        x, kernel, seg)


class ShortConv(nn.Module):
    """LFM2's gated short convolution (see the module doc); parameters ``in_b``, ``in_c``,
    ``in_x`` (transformers' in_proj, split in three), ``kernel`` [conv_width, conv_channels]
    (and ``bias``), ``out``."""

    config: object
    placement: object = None

    @nn.compact
    def __call__(self, h, segment_ids=None, decode: bool = False):
        a, e, placement = self.config.arch, self.config.execution, self.placement
        d, w, kw = a.hidden_size, a.conv.kernel, linear_kw(self.config)
        ins = [Linear((d,), (ax.EMBED, ax.CONV_CHANNELS), a.conv.bias, name=f"in_{n}", **kw) for n in "bcx"]
        b, c, x = fused(ins, h) if fuses(e) else [lin(h) for lin in ins]  # [batch, length, conv_channels]
        bx = checkpoint_name(constrain(b * x, BLC, placement), "conv_input")
        pdt = dtype_of(e.param_dtype)
        kernel = self.param("kernel", nn.with_logical_partitioning(
            nn.initializers.normal(a.initializer_range), (ax.CONV_WIDTH, ax.CONV_CHANNELS)), (w, d), pdt)
        ring = placement.ring_axes if placement is not None and not decode else ()
        if decode:
            conv = self._continue(bx, kernel, segment_ids)
        elif ring and not self.is_initializing():
            conv = ring_conv(bx, kernel, segment_ids, placement)
        elif ring:  # init runs the plain path; the length is checked when the program is built
            check_ring_chunk(bx.shape[1], w, placement)
            conv = causal_conv(bx, kernel, segment_ids)
        else:
            conv = causal_conv(bx, kernel, segment_ids)
        if a.conv.bias:
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (ax.CONV_CHANNELS,)),
                              (d,), pdt)
            conv = conv + bias.astype(conv.dtype)
        # the out projection's input, named as attention's (what remat policy save_attn_mlp keeps)
        y = checkpoint_name(constrain(c * conv, BLC, placement), "attn_context")
        out = Linear((a.hidden_size,), (ax.CONV_CHANNELS, ax.EMBED), a.conv.bias, name="out", **kw)(y)
        return checkpoint_name(out, "attn_out")  # [batch, length, embed]: the mixer's output

    def _continue(self, bx, kernel, segment_ids):
        """The convolution continuing the cached inputs; the cache keeps the last w - 1."""
        batch, h = bx.shape[0], kernel.shape[0] - 1

        def cached(name, shape, axes, dtype):
            return self.variable("cache", name, nn.with_logical_partitioning(jnp.zeros, axes), shape, dtype)

        state = cached("conv_state", (batch, h, bx.shape[2]), (ax.BATCH, ax.CONV_WIDTH, ax.CONV_CHANNELS), bx.dtype)
        state_seg = cached("conv_segment_ids", (batch, h), (ax.BATCH, ax.CONV_WIDTH), jnp.int32)
        seg = jnp.ones(bx.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        out = causal_conv(bx, kernel, seg, state.value, state_seg.value)
        state.value = jnp.concatenate([state.value, bx], axis=1)[:, -h:]
        state_seg.value = jnp.concatenate([state_seg.value, seg], axis=1)[:, -h:]
        return out


# ------------------------------------------------------------------------------ the component
@dataclasses.dataclass(frozen=True)
class ShortConvArch(SubRecord):
    """The conv layers' settings: ``kernel`` taps (LFM2's conv_L_cache); ``bias``: biases on
    in_proj, the taps and out_proj."""

    NAME: ClassVar[str] = "conv"
    FEATURE: ClassVar[str] = "short_conv"
    OWNERS: ClassVar[tuple[str, ...]] = (CONV,)
    FLAT: ClassVar[dict[str, str]] = {"conv_kernel": "kernel", "conv_bias": "bias"}

    kernel: int | None = None
    bias: bool = feature(False, "conv_bias")


def _apply(block, h, positions, segment_ids):
    return ShortConv(block.config, block.placement, name="conv")(h, segment_ids, block.decode)


def params(a) -> tuple[int, int]:
    """(in_proj's three and out_proj, and the taps, each multiplied once per token; the biases:
    in_proj 3 d, taps d, out_proj d)."""
    d = a.hidden_size
    return 4 * d * d + a.conv.kernel * d, 5 * d * a.conv.bias


def activations(cost, spec=None) -> dict:
    """The projections' outputs b, c, x (slices of their fused matmul's, which is not kept), b * x
    (the convolution's input), the convolution's output and c times it (the out projection's
    input), d channels each; and the taps' float32 0/1 segment masks, conv_kernel per token."""
    a, t = cost.config.arch, cost.t
    d = a.hidden_size
    return {"conv_in": t(3 * d, BLC), "conv_input": t(d, BLC), "conv_masks": t(a.conv.kernel, BLC[:2], 4),
            "conv_out": t(d, BLC), "attn_context": t(d, BLC)}


def cache_bytes(a, batch: int, length: int, nbytes: int) -> int:
    """The last conv_kernel - 1 inputs and their segment ids."""
    return batch * (a.conv.kernel - 1) * (a.hidden_size * nbytes + 4)


def check(a) -> None:
    kernel = a.conv.kernel
    if not isinstance(kernel, int) or isinstance(kernel, bool) or kernel < 2:
        raise ModelError(f"layer_types has {CONV} layers: conv_kernel={kernel!r} must be an integer "
                         ">= 2 (the taps of the short convolution: LFM2's conv_L_cache)")
    if a.latent:
        raise ModelError(f"layer_types has {CONV} layers beside latent attention (kv_lora_rank), "
                         "which no family has; remove one")


MIXER = Mixer(CONV, (CONV,), _apply, params, activations=activations, cache_bytes=cache_bytes, check=check,
              records=(ShortConvArch,),
              context_parallel="each chunk's taps fed the previous chunk's last conv_kernel - 1 inputs by two "
                               "ppermutes (ring_conv); the sequence is never gathered")
