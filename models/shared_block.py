"""Zamba2's shared transformer blocks: attention and an MLP whose weights serve several layers.

``num_blocks`` blocks (``shared_0``, ``shared_1``, ... at the model's top level, each stored
once) run in turn at the ``layers`` of the record: use k (the k-th such layer) runs block
``k % num_blocks`` on ``concat(x, embeddings)`` (the residual stream beside the ORIGINAL token
embeddings, 2 x hidden wide):

    h = attn(norm(concat(x, e)))           q, k, v (+ use k's low-rank adapters), rotary optional
    t = out_k(mlp_k(norm(h)))              gate|up (+ use k's adapter), down; out_k: [embed, embed]

and the layer's mixer then reads ``norm(x + t)`` (its residual stays x: ``blocks.sequential``'s
``extra``). Each use has its own adapters and output projection (named ``..._{k}`` in its block)
and its own KV cache (``cached_key_{k}``...). Those layers are unrolled: each has its own
``LayerSpec.shared`` (its use), so no scan step can run them (``check_layout``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from flax import linen as nn

from shardzoo.models import ModelError
from shardzoo.models.attention import Attention, own_layer
from shardzoo.models.attention_costs import BHL, BLHD, BLKD
from shardzoo.models.attention_costs import flops as attention_flops
from shardzoo.models.attention_kernels import (
    attention_mask,
    keys_transposed,
    unpacked,
    xla_attention,
)
from shardzoo.models.component import SubRecord
from shardzoo.models.layers import ACTIVATIONS, Linear, constrain, linear_kw
from shardzoo.models.norms import make_norm, norm_params
from shardzoo.models.rope import apply_rope, rope_frequencies
from shardzoo.sharding import axes as ax


@dataclasses.dataclass(frozen=True)
class SharedBlockArch(SubRecord):
    """Where the shared blocks run (``layers``), how many there are (``num_blocks``: Zamba2's
    num_mem_blocks), the adapters' rank, whether q, k, v have adapters too (the MLP always has),
    whether the shared attention rotates (use_mem_rope)."""

    NAME: ClassVar[str] = "shared_block"
    FEATURE: ClassVar[str] = "shared_block"
    FLAT: ClassVar[dict[str, str]] = {"shared_block_layers": "layers", "num_mem_blocks": "num_blocks",
                                      "adapter_rank": "adapter_rank",
                                      "use_shared_attention_adapter": "attention_adapters", "use_mem_rope": "rope"}

    layers: tuple[int, ...] = ()
    num_blocks: int = 1
    adapter_rank: int = 128
    attention_adapters: bool = False
    rope: bool = False

    def __post_init__(self):
        if isinstance(self.layers, list):
            object.__setattr__(self, "layers", tuple(self.layers))

    def used(self, arch) -> bool:
        return bool(self.layers)

    def check(self, arch) -> None:
        n = arch.num_hidden_layers
        if list(self.layers) != sorted(set(self.layers)) or any(not 0 <= i < n for i in self.layers):
            raise ModelError(f"shared_block_layers={list(self.layers)} must be increasing layer indices in 0..{n - 1}")
        for name in ("num_blocks", "adapter_rank"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ModelError(f"{name}={getattr(self, name)!r} must be an integer >= 1")
        if arch.block_form != "sequential" or arch.norm_position != "pre" or arch.norm_positions is not None:
            raise ModelError("shared blocks (shared_block_layers) feed the next mixer's pre-norm: block_form must be "
                             "'sequential' and norm_position 'pre'")
        if self.attention_adapters and arch.kv_heads * arch.head_size != 2 * arch.hidden_size:
            raise ModelError(f"use_shared_attention_adapter: the adapters give 2 x hidden_size = {2 * arch.hidden_size}"
                             f" features to k and v: num_key_value_heads x head_dim = {arch.kv_heads * arch.head_size}")


def check_layout(a, layout) -> None:
    """A ModelError if a scanned step would run a layer with a shared block (they are unrolled)."""
    scanned = range(layout.prefix, layout.prefix + layout.scanned)
    if a.shared_block and any(i in scanned for i in a.shared_block.layers):
        raise ModelError(f"scan_layout={list(layout.as_tuple())} scans layers of shared_block_layers="
                         f"{list(a.shared_block.layers)}, which run unrolled; choose a layout without them")


def _sizes(a) -> tuple[int, int]:
    """(matmul parameters of one block, of one use: its adapters and output projection)."""
    s, d, f, hd = a.shared_block, a.hidden_size, a.intermediate_size, a.head_size
    block = 2 * d * (a.num_attention_heads + 2 * a.kv_heads) * hd + a.num_attention_heads * hd * d + 3 * d * f
    use = d * d + d * s.adapter_rank + s.adapter_rank * 2 * f
    if s.attention_adapters:
        use += s.adapter_rank * (3 * 2 * d + (a.num_attention_heads + 2 * a.kv_heads) * hd)
    return block, use


def params(a) -> int:
    """The shared blocks' parameters (each block once, with its two norms) and every use's."""
    if a.shared_block is None:
        return 0
    block, use = _sizes(a)
    norms = norm_params(a, 2 * a.hidden_size) + norm_params(a, a.hidden_size)
    return a.shared_block.num_blocks * (block + norms) + len(a.shared_block.layers) * use


def flops(a, seq_len: int) -> float:
    """Training FLOPs per token of every use: 6 x its matmul parameters and its causal attention."""
    from shardzoo.models.arch import LayerSpec  # arch reads this module's record

    if a.shared_block is None:
        return 0.0
    block, use = _sizes(a)
    return len(a.shared_block.layers) * (6 * (block + use) + attention_flops(a, LayerSpec(), seq_len))


def activations(a, seq_len: int, t) -> int:
    """What every use keeps for the backward (``t``: ``costs.LayerCost.t``): the uses run outside
    the layers' remat, so every array of theirs whatever the policy: the 2 x hidden input and its
    norm, q, k, v and the adapters' latents, XLA attention's scores and float32 probabilities,
    the context, the MLP's input, gate, up and their product, the down and output projections."""
    if a.shared_block is None:
        return 0
    s, d, f, hd, h = a.shared_block, a.hidden_size, a.intermediate_size, a.head_size, a.num_attention_heads
    ble, blm, blr = (ax.BATCH, ax.LENGTH, ax.EMBED), (ax.BATCH, ax.LENGTH, ax.MLP), (ax.BATCH, ax.LENGTH, ax.LORA_RANK)
    use = (t(4 * d, ble) + t(h * hd, BLHD) + t(2 * a.kv_heads * hd, BLKD)
           + t((1 + 3 * s.attention_adapters) * s.adapter_rank, blr)
           + t(h * seq_len, BHL) + t(h * seq_len, BHL, 4) + t(h * hd, BLHD)
           + t(4 * d, ble) + t(3 * f, blm))
    return len(s.layers) * use


class SharedAttention(Attention):
    """The shared block's attention: q, k, v of the 2 x hidden input (plus use ``use``'s
    adapters), the logits' scale ``arch.attention_scale``; its cache per use."""

    use: int = 0

    def _cached(self, name, shape, axes, dtype):
        return super()._cached(f"{name}_{self.use}", shape, axes, dtype)

    def _adapter(self, name, x, shape, axes):
        rank = self.config.arch.shared_block.adapter_rank
        low = Linear((rank,), (ax.EMBED, ax.LORA_RANK), name=f"{name}_adapter_{self.use}_a", **linear_kw(self.config))(x)
        return Linear(shape, (ax.LORA_RANK, *axes), name=f"{name}_adapter_{self.use}_b", **linear_kw(self.config))(low)

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, decode: bool = False):
        a, placement, kw = self.config.arch, self.placement, linear_kw(self.config)
        heads = {"q": ((a.num_attention_heads, a.head_size), ax.HEADS),
                 "k": ((a.kv_heads, a.head_size), ax.KV_HEADS), "v": ((a.kv_heads, a.head_size), ax.KV_HEADS)}
        out = {}
        for n, (shape, axis) in heads.items():
            out[n] = Linear(shape, (ax.EMBED, axis, ax.HEAD_DIM), name=n, **kw)(x)
            if a.shared_block.attention_adapters:
                out[n] = out[n] + self._adapter(n, x, shape, (axis, ax.HEAD_DIM))
        q, k, v = out["q"], out["k"], out["v"]
        if a.shared_block.rope:
            inv_freq, factor = rope_frequencies(a, positions)
            q, k = apply_rope(q, positions, inv_freq, factor), apply_rope(k, positions, inv_freq, factor)
        q = constrain(q, (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM), placement)
        batch, length = x.shape[:2]
        if decode:
            k, v, mask, _, layer = self._update_cache(k, v, segment_ids, batch, length, None)
            k, v = own_layer(k, v, layer)
            k, v = unpacked(k, q.shape[-1], keys_transposed(self.config.execution)), unpacked(v, q.shape[-1])
        else:
            mask = attention_mask(positions, positions, segment_ids, segment_ids, None)
        ctx = xla_attention(q, k, v, mask, a.attention_scale)  # [batch, length, heads, head_dim]
        return Linear((a.hidden_size,), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), name="o", **kw)(ctx)


class SharedBlock(nn.Module):
    """One shared block (see the module doc); ``use`` selects its adapters, output projection and cache."""

    config: object
    placement: object = None

    @nn.compact
    def __call__(self, x, embeds, positions, segment_ids, use: int, decode: bool):
        cfg, a, kw = self.config, self.config.arch, linear_kw(self.config)
        ble = (ax.BATCH, ax.LENGTH, ax.EMBED)
        h = make_norm(cfg, "attn_norm")(jnp.concatenate([x, embeds], axis=-1))
        h = SharedAttention(cfg, None, self.placement, use=use, name="attn")(h, positions, segment_ids, decode)
        h = make_norm(cfg, "mlp_norm")(constrain(h, ble, self.placement))
        low = Linear((a.shared_block.adapter_rank,), (ax.EMBED, ax.LORA_RANK), name=f"mlp_adapter_{use}", **kw)(h)
        gate, up = (Linear((a.intermediate_size,), (ax.EMBED, ax.MLP), name=n, **kw)(h)
                    + Linear((a.intermediate_size,), (ax.LORA_RANK, ax.MLP), name=f"{n}_adapter_{use}", **kw)(low)
                    for n in ("gate", "up"))
        h = Linear((a.hidden_size,), (ax.MLP, ax.EMBED), name="down", **kw)(ACTIVATIONS[a.hidden_act](gate) * up)
        h = Linear((a.hidden_size,), (ax.EMBED, ax.MLP), name=f"out_{use}", **kw)(constrain(h, ble, self.placement))
        return constrain(h, ble, self.placement)


def shared_inputs(config, placement, embeds, positions, segment_ids, decode: bool):
    """``extra(i, x)``: what layer i's mixer adds to its input before its norm (its shared block's
    output), None for a layer without one. Builds the blocks under the calling module."""
    s = config.arch.shared_block
    if s is None:
        return lambda i, x: None
    blocks = [SharedBlock(config, placement, name=f"shared_{b}") for b in range(s.num_blocks)]
    uses = {layer: k for k, layer in enumerate(s.layers)}

    def extra(i, x):
        k = uses.get(i)
        return None if k is None else blocks[k % s.num_blocks](x, embeds, positions, segment_ids, k, decode)

    return extra
