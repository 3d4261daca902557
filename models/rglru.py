"""RecurrentGemma's (Griffin's) recurrent block: the token mixer of the "recurrent" layers.

``y = gelu(linear_y(h))``; ``x = linear_x(h)`` through a causal depthwise convolution (with bias)
and the RG-LRU; ``out = linear_out(x * y)``. The RG-LRU's lru_width channels are
``num_attention_heads`` blocks (``ssm_heads``, which tensor-parallel shards) of features
(``ssm_head_dim``); per block, block-diagonal input and recurrence gates

    i_t = sigmoid(x_t W_i + b_i),  r_t = sigmoid(x_t W_r + b_r),  log a_t = -8 r_t softplus(c),
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t),

a token at position 0 resetting the state (a = 0, its input not scaled: packed segments restart
there; the convolution reads no tap of another segment). Training runs the
recurrence as one associative scan over the length (``rglru_scan``: the state is the width of
the block's channels, no larger); decoding keeps the convolution's last w - 1 inputs and the
float32 state, and continues them (``rglru_steps``, the tests' reference, token by token).
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
from shardzoo.models.conv_mixer import causal_conv
from shardzoo.models.layers import Linear, activation, constrain, dtype_of, linear_kw
from shardzoo.sharding import axes as ax

RECURRENT = "recurrent"  # its name in layer_types
CH = (ax.SSM_HEADS, ax.SSM_HEAD_DIM)  # the lru_width channels: blocks of features
BLC = (ax.BATCH, ax.LENGTH, *CH)


def rglru_scan(a, u, state=None):
    """h_t = a_t h_{t-1} + u_t over the length (axis 1) by an associative scan, float32; ``state``
    the h before the first token (None: zeros). Returns (h of every token, the last h)."""
    a, u = a.astype(jnp.float32), u.astype(jnp.float32)
    if state is not None:
        u = u.at[:, 0].add(a[:, 0] * state)
    _, h = jax.lax.associative_scan(lambda e, f: (e[0] * f[0], f[0] * e[1] + f[1]), (a, u), axis=1)
    return h, h[:, -1]


def rglru_steps(a, u, state=None):
    """The same recurrence token by token (``rglru_scan``'s reference)."""
    state = jnp.zeros(u[:, 0].shape, jnp.float32) if state is None else state

    def step(h, inputs):
        h = inputs[0] * h + inputs[1]
        return h, h

    final, h = jax.lax.scan(step, state, (jnp.moveaxis(a.astype(jnp.float32), 1, 0),
                                          jnp.moveaxis(u.astype(jnp.float32), 1, 0)))
    return jnp.moveaxis(h, 0, 1), final


class RecurrentBlock(nn.Module):
    """The recurrent block (see the module doc). Parameters: ``linear_y``, ``linear_x`` [embed,
    blocks, features] with biases, ``conv`` [conv1d_width, blocks, features] and ``conv_bias``,
    ``input_gate`` and ``recurrent_gate`` [blocks, features, features] with their biases (the
    gates' outputs, the state's features, named ``ssm_state``),
    ``recurrent_param`` [blocks, features], ``linear_out`` with its bias."""

    config: object
    placement: object = None

    @nn.compact
    def __call__(self, h, positions, segment_ids=None, decode: bool = False):
        a, e, placement = self.config.arch, self.config.execution, self.placement
        if placement is not None and placement.ring_axes and not decode and not self.is_initializing():
            raise ModelError("recurrent (RG-LRU) layers have no context-parallel form: the rules must not shard length")
        nb = a.num_attention_heads
        bw = a.rglru.lru_width // nb
        kw, pdt = linear_kw(self.config), dtype_of(e.param_dtype)
        y = Linear((nb, bw), (ax.EMBED, *CH), True, name="linear_y", **kw)(h)  # [batch, length, blocks, features]
        y = activation(a.hidden_act)(y)
        x = constrain(Linear((nb, bw), (ax.EMBED, *CH), True, name="linear_x", **kw)(h), BLC, placement)
        x = self._conv(x, segment_ids, decode)
        reset = (positions == 0)[:, :, None, None]  # [batch, length, 1, 1]
        gate = lambda name, init: jnp.einsum(  # noqa: E731
            "blhi,hij->blhj", x, self.param(f"{name}_weight", nn.with_logical_partitioning(init, (*CH, ax.SSM_STATE)),
                                            (nb, bw, bw), pdt).astype(x.dtype)) + self.param(
            f"{name}_bias", nn.with_logical_partitioning(nn.initializers.zeros, CH), (nb, bw), pdt).astype(x.dtype)
        init = nn.initializers.normal((0.01 / a.rglru.conv1d_width) ** 0.5)
        i_gate, r_gate = jax.nn.sigmoid(gate("input_gate", init)), jax.nn.sigmoid(gate("recurrent_gate", init))
        c = self.param("recurrent_param", nn.with_logical_partitioning(nn.initializers.ones, CH), (nb, bw), pdt)
        log_a = -8.0 * r_gate.astype(jnp.float32) * jax.nn.softplus(c.astype(jnp.float32))
        decay = jnp.where(reset, 0.0, jnp.exp(log_a))
        scale = jnp.where(reset, 1.0, jnp.sqrt(1 - jnp.exp(2 * log_a)))
        u = (x * i_gate).astype(jnp.float32) * scale.astype(x.dtype).astype(jnp.float32)
        if decode:
            state = self.variable("cache", "rglru_state", nn.with_logical_partitioning(jnp.zeros, (ax.BATCH, *CH)),
                                  (h.shape[0], nb, bw), jnp.float32)
            run = rglru_steps if h.shape[1] == 1 else rglru_scan
            out, state.value = run(decay, u, state.value)
        else:
            out, _ = rglru_scan(decay, u)
        out = checkpoint_name(constrain(out.astype(h.dtype) * y, BLC, placement), "attn_context")
        out = Linear((a.hidden_size,), (*CH, ax.EMBED), True, name="linear_out", **kw)(out)
        return checkpoint_name(out, "attn_out")  # [batch, length, embed]

    def _conv(self, x, segment_ids, decode):
        """The causal depthwise convolution (with bias) of x [batch, length, blocks, features], no
        tap reaching into another packed segment; decoding continues the cached inputs."""
        w, pdt = self.config.arch.rglru.conv1d_width, dtype_of(self.config.execution.param_dtype)
        shape = x.shape
        kernel = self.param("conv", nn.with_logical_partitioning(
            nn.initializers.normal(self.config.arch.initializer_range), (ax.CONV_WIDTH, *CH)), (w, *shape[2:]), pdt)
        flat, kernel = x.reshape(shape[:2] + (-1,)), kernel.reshape(w, -1)  # channels: blocks x features
        if decode:
            prev = self.variable("cache", "conv_state", nn.with_logical_partitioning(
                jnp.zeros, (ax.BATCH, ax.CONV_WIDTH, ax.SSM_HEADS)), (shape[0], w - 1, flat.shape[2]), x.dtype)
            out = causal_conv(flat, kernel, None, prev.value)
            prev.value = jnp.concatenate([prev.value, flat], axis=1)[:, 1 - w:]
        else:
            out = causal_conv(flat, kernel, segment_ids)
        bias = self.param("conv_bias", nn.with_logical_partitioning(nn.initializers.zeros, CH), shape[2:], pdt)
        return out.reshape(shape) + bias.astype(out.dtype)


# ------------------------------------------------------------------------------ the component
@dataclasses.dataclass(frozen=True)
class RglruArch(SubRecord):
    """The recurrent layers' settings: the RG-LRU's width (lru_width, in num_attention_heads
    blocks) and the convolution's taps (conv1d_width)."""

    NAME: ClassVar[str] = "rglru"
    FEATURE: ClassVar[str] = "rglru"
    OWNERS: ClassVar[tuple[str, ...]] = (RECURRENT,)
    FLAT: ClassVar[dict[str, str]] = {"lru_width": "lru_width", "conv1d_width": "conv1d_width"}

    lru_width: int = 0
    conv1d_width: int = 4

    def check(self, arch) -> None:
        if not isinstance(self.lru_width, int) or isinstance(self.lru_width, bool) or self.lru_width < 1 \
                or self.lru_width % arch.num_attention_heads:
            raise ModelError(f"layer_types has {RECURRENT} layers: lru_width={self.lru_width!r} must be a positive "
                             f"multiple of num_attention_heads={arch.num_attention_heads} (the RG-LRU's blocks)")
        if not isinstance(self.conv1d_width, int) or self.conv1d_width < 2:
            raise ModelError(f"conv1d_width={self.conv1d_width!r} must be an integer >= 2 (the convolution's taps)")


def _apply(block, h, positions, segment_ids):
    """The recurrent block of the normed input ``h`` (its path: ``recurrent``)."""
    return RecurrentBlock(block.config, block.placement, name="recurrent")(h, positions, segment_ids, block.decode)


def params(a) -> tuple[int, int]:
    """(linear_y, linear_x, linear_out, the gates and the convolution's taps; the biases and recurrent_param)."""
    w, d = a.rglru.lru_width, a.hidden_size
    bw = w // a.num_attention_heads
    return 3 * d * w + 2 * w * bw + a.rglru.conv1d_width * w, 2 * w + d + w + 2 * w + w


def flops(a, spec, seq_len: int) -> float:
    """The scan's combines and the gating per channel and token (a few multiply-adds), 2 x 3 FLOPs each."""
    return 6 * 6 * a.rglru.lru_width


def decode_flops(a, spec, context: float) -> float:
    return 2 * 3 * a.rglru.lru_width


def activations(cost, spec=None) -> dict:
    """linear_y's and linear_x's outputs, the convolution's, the gates (float32), the scan's
    decays, inputs and states (float32), the gated output."""
    w, t = cost.config.arch.rglru.lru_width, cost.t
    bl = (ax.BATCH, ax.LENGTH, ax.SSM_HEADS)
    return {"rglru_in": t(3 * w, bl), "rglru_gates": t(2 * w, bl, 4), "rglru_scan": t(3 * w, bl, 4),
            "attn_context": t(w, bl)}


def cache_bytes(a, batch: int, length: int, nbytes: int) -> int:
    """The float32 state and the convolution's last inputs."""
    w = a.rglru.lru_width
    return batch * (4 * w + (a.rglru.conv1d_width - 1) * w * nbytes)


MIXER = Mixer(RECURRENT, (RECURRENT,), _apply, params, flops, decode_flops, activations, cache_bytes=cache_bytes,
              context_parallel="none: the rules must not shard length (refused at the first call)",
              records=(RglruArch,))
