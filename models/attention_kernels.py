"""Attention's masks and kernels: the boolean mask of causality, windows, chunks and packed
segments, attention in plain XLA ops (soft-capped logits, sinks) and of one decoding query over
the cache, and the choice of kernel (XLA, cuDNN or splash, ``models/splash.py``) for a layer.
The ``Attention`` block that runs them is ``models/attention.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shardzoo.models import splash
from shardzoo.sharding import axes as ax

# The decoding cache of keys and values, as a step reads it: per row and kv head, the positions
# then the features (``one_query_attention`` contracts head_dim, then cache_length, in place).
KV_CACHE_AXES = (ax.BATCH, ax.KV_HEADS, ax.CACHE_LENGTH, ax.HEAD_DIM)


def attention_mask(q_slots, k_slots, q_segments, k_segments, sliding_window, chunk=None):
    """Boolean mask [batch, 1, q_len, k_len]: causal, same segment, within the window or chunk.

    Slots are each token's index in its row (cache slot when decoding); a query at i sees a
    key at j when j <= i, i - j < sliding_window, i // chunk == j // chunk (chunked
    attention: Llama 4's attention_chunk_size), and their segment ids are equal.
    """
    i, j = q_slots[:, None, :, None], k_slots[:, None, None, :]
    mask = j <= i
    if sliding_window:
        mask &= i - j < sliding_window
    if chunk:
        mask &= i // chunk == j // chunk
    if q_segments is not None:
        mask &= q_segments[:, None, :, None] == k_segments[:, None, None, :]
    return mask


def attention_kernel(config, dtype, length):
    """"xla", "cudnn" or "splash" for a layer's attention over rows of ``length``: ``auto`` takes
    splash on a TPU, cuDNN on a GPU, where each can; splash leaves lengths it cannot tile to XLA."""
    impl = config.execution.attention_impl
    if impl == "auto":
        backend, head = jax.default_backend(), config.arch.head_size
        fits = head % 8 == 0 and head <= 256  # cuDNN flash attention's limits
        if backend == "tpu" and not splash.serves(config.arch):
            impl = "splash"
        else:
            impl = "cudnn" if backend == "gpu" and fits and dtype in (jnp.bfloat16, jnp.float16) else "xla"
    return "xla" if impl == "splash" and splash.block_size(length) is None else impl


def softcap(x, cap):
    """``cap * tanh(x / cap)``: values squashed smoothly into (-cap, cap) (Gemma 2)."""
    return cap * jnp.tanh(x / cap)


def xla_attention(q, k, v, mask, scale, logit_cap=None, sinks=None, bias=None):
    """Attention in plain XLA ops, for what ``jax.nn.dot_product_attention`` cannot take
    (soft-capped logits, sinks, ALiBi): scores scaled, biased, capped, masked, softmax in float32
    (as HF's eager).

    q: [batch, q_len, heads, head_dim]; k, v: [batch, k_len, kv_heads, head_dim];
    mask: bool [batch, 1, q_len, k_len]. Query heads are grouped over their kv head (GQA).
    ``sinks`` [heads]: each head's learned logit, one more column of the softmax that attends
    no value (GPT-OSS): the weights of the keys sum to less than 1. ``bias``: float32 [batch,
    heads, q_len, k_len] added to the scaled scores (ALiBi: ``models/alibi.py``).
    """
    batch, length, heads, dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, length, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("blkgd,bmkd->bkglm", q, k) * jnp.asarray(scale, q.dtype)
    # [batch, kv_heads, group, q_len, k_len]
    if bias is not None:
        scores = scores.astype(jnp.float32) + bias.reshape(batch, kv_heads, heads // kv_heads, *bias.shape[2:])
    if logit_cap:
        scores = softcap(scores, jnp.asarray(logit_cap, scores.dtype))
    scores = jnp.where(mask[:, :, None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    else:  # [batch, kv_heads, group, q_len, k_len + 1]: the sink last, dropped after the softmax
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, heads // kv_heads, 1, 1),
                                scores.shape[:-1] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
    ctx = jnp.einsum("bkglm,bmkd->blkgd", probs, v)
    return ctx.reshape(batch, length, heads, v.shape[-1])  # [batch, length, heads, head_dim]


def one_query_attention(q, k, v, mask, scale):
    """Attention of one new token per row over the cache (a decoding step), the cache read in its
    own layout (``KV_CACHE_AXES``): batch and kv heads lead, so both products are batched matmuls
    with no transpose of the cache. Scores and softmax in float32.

    q: [batch, 1, heads, head_dim]; k, v: [batch, kv_heads, k_len, head_dim]; mask: bool
    [batch, 1, 1, k_len]. Returns [batch, 1, heads, head_dim].
    """
    batch, _, heads, dim = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(batch, kv_heads, heads // kv_heads, dim) * jnp.asarray(scale, q.dtype)
    scores = jnp.einsum("bkgd,bkmd->bkgm", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, :, 0, None, :], scores, jnp.finfo(jnp.float32).min)  # [batch, kv_heads, group, k_len]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    ctx = jnp.einsum("bkgm,bkmd->bkgd", probs, v)
    return ctx.reshape(batch, 1, heads, v.shape[-1])
