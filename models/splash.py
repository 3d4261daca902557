"""Pallas splash attention (TPU): causal, packed rows, GQA/MQA, windows, chunks, soft-capped logits.

``splash_attention`` takes the model's layout, q [batch, length, heads, head_dim] and k, v [batch,
length, kv_heads, head_dim], and runs jax's block-sparse flash kernel
(``jax.experimental.pallas.ops.tpu.splash_attention``) on each batch row's [heads, length,
head_dim]: the scores never exist in memory, and blocks the mask hides entirely are skipped.
Query heads share their kv head in the kernel itself (GQA; one kv head: the MQA kernel). A head
width other than 64 or a multiple of 128 is zero-padded to the next multiple of 128 (q.k is
unchanged; the value's padding is sliced off). Off a TPU it runs in Pallas' interpret mode
(tests; slow).

Where it serves (``serves``): not attention sinks (GPT-OSS), not ALiBi (BLOOM, MPT) and not latent attention (value and
key widths differ); those layers stay in XLA. A length that is not a multiple of 128, a decoding
step and context parallelism (the XLA ring: merging per-step kernel calls needs their
log-sum-exp residuals, not wired yet) also run in XLA.

Under a mesh the kernel (a Pallas call, which GSPMD cannot partition) runs inside a
``jax.shard_map`` over the mesh axes that hold batch and heads (heads only where query and kv
heads split alike); any other sharding of these arrays is gathered at its edge.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from shardzoo.models.ring_attention import other_axes, spec_of
from shardzoo.sharding import axes as ax

LANES = 128  # the kernel's blocks along the length are multiples of this
_BLOCKS = (512, 256, 128)
# the checkpoint name of the forward kernel's output and log-sum-exp, all its backward needs
# beside q, k, v: a remat policy that saves them (save_qkv_mlp) never reruns the forward kernel
RESIDUALS = "attn_kernel"


def serves(arch) -> str | None:
    """Why splash attention cannot run this architecture's attention (None: it can)."""
    if arch.latent:
        return "latent attention (values narrower than keys) runs in plain XLA"
    if arch.value_heads and arch.value_heads.head_dim:
        return "value_head_dim (values narrower than keys) runs in plain XLA"
    if arch.attention_sinks:
        return "attention_sinks (a learned logit per head in the softmax) runs in plain XLA"
    if arch.position_embedding == "alibi":
        return "position_embedding='alibi' (a bias on the attention logits, which the kernel has no input for) runs in plain XLA"
    return None


def block_size(length: int) -> int | None:
    """The largest of 512, 256, 128 that divides ``length`` (None: the kernel cannot tile it)."""
    return next((b for b in _BLOCKS if length % b == 0), None)


def padded_width(head_dim: int) -> int:
    """The head width the kernel gets: 64 or a multiple of 128 as is, else the next multiple of 128."""
    return head_dim if head_dim == 64 or head_dim % LANES == 0 else -(-head_dim // LANES) * LANES


def _chunk_segments(segment_ids, positions, chunk):
    """Ids that change where the segment or the position's chunk does: causal attention within
    them is chunked attention by position (``attention_mask``), packed rows or not; exact where
    an index-chunked mask would need positions to be the token indices. [batch, length]"""
    key = positions // chunk if segment_ids is None else jnp.stack([segment_ids, positions // chunk], -1)
    key = key.reshape(key.shape[:2] + (-1,))
    new = jnp.any(key[:, 1:] != key[:, :-1], axis=-1)
    return jnp.concatenate([jnp.zeros_like(new[:, :1]), new], axis=1).astype(jnp.int32).cumsum(axis=1)


def _mask(length, heads, window):
    one = (sm.LocalMask((length, length), window_size=(window - 1, 0), offset=0) if window
           else sm.CausalMask((length, length)))  # chunks come as segment ids (``_chunk_segments``)
    return sm.MultiHeadMask([one] * heads)


def _local(q, k, v, seg, *, window, cap, block_q, interpret):
    """On one device: q [batch, length, heads, head_dim], k, v [batch, length, kv_heads, head_dim]
    (head_dim already the kernel's), seg [batch, length] or None."""
    batch, length, heads, _ = q.shape
    kv_heads = k.shape[2]
    b = block_size(length)
    bq = block_q if block_q and length % block_q == 0 else b
    # one backward kernel for dq and dk/dv (MaxText's sa_use_fused_bwd_kernel): the attention
    # probabilities are recomputed once in the backward, not once per gradient
    blocks = sk.BlockSizes(block_q=bq, block_kv=b, block_kv_compute=b, block_q_dkv=bq, block_kv_dkv=b,
                           block_kv_dkv_compute=b, use_fused_bwd_kernel=True)
    make = sk.make_splash_mqa if kv_heads == 1 else sk.make_splash_mha
    kernel = make(_mask(length, heads, window), block_sizes=blocks, head_shards=1, q_seq_shards=1,
                  attn_logits_soft_cap=cap, residual_checkpoint_name=RESIDUALS, interpret=interpret)
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [batch, heads|kv_heads, length, head_dim]
    if kv_heads == 1:
        k, v = k[:, 0], v[:, 0]  # [batch, length, head_dim]
    if seg is None:
        out = jax.vmap(kernel)(q, k, v)
    else:
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sk.SegmentIds(s, s)))(q, k, v, seg)
    return jnp.swapaxes(out, 1, 2)  # [batch, length, heads, head_dim]


def splash_attention(q, k, v, segment_ids, positions, *, scale, sliding_window=None, chunk=None,
                     logit_cap=None, placement=None, block_q=None, interpret=None):
    """Causal attention of q [batch, length, heads, head_dim] over k, v [batch, length, kv_heads,
    head_dim] by the splash kernel; equal to ``attention_mask``'s (by position within packed
    segments) plus ``xla_attention``. Needs ``block_size(length)``. ``block_q``: the query tile
    where it divides the length (None: ``block_size``). ``interpret``: None runs Pallas'
    interpreter anywhere but on a TPU."""
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    dim = q.shape[-1]
    width = padded_width(dim)
    q = q * jnp.asarray(scale, q.dtype)
    if width != dim:  # zeros add nothing to q.k; the padded value features are dropped below
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, width - dim)))  # noqa: E731
        q, k, v = pad(q), pad(k), pad(v)
    seg = _chunk_segments(segment_ids, positions, chunk) if chunk else segment_ids
    fn = functools.partial(_local, window=sliding_window, cap=logit_cap, block_q=block_q, interpret=interpret)
    if placement is None:
        out = fn(q, k, v, seg)
    else:
        out = _sharded(fn, q, k, v, seg, placement)
    return out[..., :dim]


def shard_spec(placement, batch: int, heads: int, kv_heads: int):
    """The shard_map spec of q, k, v [batch, length, heads, head_dim]: batch over its mesh axes,
    heads over theirs where query and kv heads split alike (else whole on each device)."""
    batch_axes = other_axes(placement, ax.BATCH, (batch,), ())
    head_axes = other_axes(placement, ax.HEADS, (heads, kv_heads), batch_axes)
    if head_axes != other_axes(placement, ax.KV_HEADS, (heads, kv_heads), batch_axes):
        head_axes = ()
    return spec_of(batch_axes, None, head_axes, None)


def _sharded(fn, q, k, v, seg, placement):
    """``fn`` in a shard_map (``shard_spec``); length and head_dim whole on each device. The
    kernel's outputs declare no varying mesh axes, which ``check_vma`` requires: off (gradients
    of inputs replicated over other axes were checked against one device)."""
    qkv = shard_spec(placement, q.shape[0], q.shape[2], k.shape[2])
    if seg is None:
        return jax.shard_map(lambda q, k, v: fn(q, k, v, None), mesh=placement.mesh, in_specs=(qkv,) * 3,
                             out_specs=qkv, check_vma=False)(q, k, v)
    return jax.shard_map(fn, mesh=placement.mesh, in_specs=(qkv,) * 3 + (spec_of(qkv[0], None),),
                         out_specs=qkv, check_vma=False)(q, k, v, seg)
