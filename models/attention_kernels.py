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
# The keys transposed, positions minor (``keys_transposed``: on a CPU).
KEY_CACHE_T_AXES = (ax.BATCH, ax.KV_HEADS, ax.HEAD_DIM, ax.CACHE_LENGTH)


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


@jax.custom_vjp
def softmax(x):
    """``jax.nn.softmax`` over the last axis with its backward from the output alone
    (``y * (g - sum(g * y))``): the probabilities are the one residual a layer keeps (jax's own
    softmax also keeps its unnormalized exponentials, a second [batch, heads, q_len, k_len]
    array per layer that a layer scan stacks)."""
    return jax.nn.softmax(x, axis=-1)


def _softmax_fwd(x):
    y = softmax(x)
    return y, y


def _softmax_bwd(y, g):
    return (y * (g - jnp.sum(g * y, axis=-1, keepdims=True)),)


softmax.defvjp(_softmax_fwd, _softmax_bwd)


def causal_attention(q, k, v, segment_ids, window, scale, impl):
    """Causal attention of a training or scoring call (by index, within packed segments and the
    window): ``jax.nn.dot_product_attention`` (``impl`` "xla" or "cudnn"), except XLA's in float32
    on a CPU, which runs ``xla_attention``, the same arithmetic with a lighter softmax backward
    (BENCHMARKS.md, the CPU section). Shapes as ``xla_attention``'s; ``segment_ids`` [batch,
    length] or None."""
    if impl == "xla" and q.dtype == jnp.float32 and jax.default_backend() == "cpu":
        batch, length = q.shape[:2]
        slots = jnp.broadcast_to(jnp.arange(length), (batch, length))
        return xla_attention(q, k, v, attention_mask(slots, slots, segment_ids, segment_ids, window), scale)
    mask = None
    if segment_ids is not None:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                        local_window_size=(window - 1, 0) if window else None,
                                        implementation=impl)


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
        probs = softmax(scores).astype(v.dtype)
    else:  # [batch, kv_heads, group, q_len, k_len + 1]: the sink last, dropped after the softmax
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, heads // kv_heads, 1, 1),
                                scores.shape[:-1] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
    ctx = jnp.einsum("bkglm,bmkd->blkgd", probs, v)
    return ctx.reshape(batch, length, heads, v.shape[-1])  # [batch, length, heads, head_dim]


def kv_pack(execution, head_dim: int, kv_heads: int) -> int:
    """How many kv heads share a row of the decoding cache, their features side by side
    (``kv_cache_packing``): 128 // head_dim where head_dim divides 128 and that many divide
    kv_heads, on a TPU ("auto") or when "on"; else 1. A TPU lays a cache of 64 features out
    positions-minor (sparing the padding to its 128 lanes), where writing one position per step
    rewrote every tile of every layer's cache (a third of llama3.2-1b's batch-32 step)."""
    on = execution.kv_cache_packing == "on" or (execution.kv_cache_packing == "auto"
                                                  and jax.default_backend() == "tpu")
    pack = 128 // head_dim if on and head_dim < 128 and 128 % head_dim == 0 else 1
    return pack if kv_heads % pack == 0 else 1


def keys_transposed(execution) -> bool:
    """Whether the decoding cache holds its keys transposed, [batch, kv_heads / pack, pack *
    head_dim, cache_length] (``KEY_CACHE_T_AXES``; ``kv_cache_transposed_keys``: "on", or "auto"
    on a CPU, the one place this is chosen by backend). A step's scores then sum the features
    over a major axis, vectorized along the positions: XLA:CPU's batched matmul contracting the
    keys' minor features (the plain layout) took 3x as long, the largest op of a batch-16 step
    after the weights' matmuls (``bench/bench_decode.py``). The values keep ``KV_CACHE_AXES``:
    their product with the probabilities already sums over a major axis."""
    setting = execution.kv_cache_transposed_keys
    return setting == "on" or (setting == "auto" and jax.default_backend() == "cpu")


def packed(x, pack: int):
    """Keys or values [batch, length, kv_heads, head_dim] as the cache holds them:
    [batch, kv_heads / pack, length, pack * head_dim] (``KV_CACHE_AXES``, ``kv_pack``)."""
    batch, length, heads, dim = x.shape
    return jnp.swapaxes(x.reshape(batch, length, heads // pack, pack * dim), 1, 2)


def unpacked(x, head_dim: int, transposed: bool = False):
    """The cache's keys or values back as [batch, length, kv_heads, head_dim] (``packed``'s
    inverse; ``transposed``: keys held positions minor, ``keys_transposed``)."""
    x = jnp.swapaxes(x, 2, 3) if transposed else x
    batch, rows, length, width = x.shape
    return jnp.swapaxes(x, 1, 2).reshape(batch, length, rows * width // head_dim, head_dim)


def grouped_queries(q, rows: int, pack: int):
    """One decoding query per row [batch, 1, heads, head_dim] as the rows of a packed cache meet
    it: [batch, rows, pack * group, pack * head_dim], each kv head's query heads laid
    block-diagonally over its features in the row (zeros against the other heads' features)."""
    batch, _, heads, dim = q.shape
    group = heads // (rows * pack)
    if pack == 1:
        return q.reshape(batch, rows, group, dim)
    q = q.reshape(batch, rows, pack, group, dim)
    eye = jnp.eye(pack, dtype=q.dtype)
    return jnp.einsum("bjhgd,hx->bjhgxd", q, eye).reshape(batch, rows, pack * group, pack * dim)


def own_heads(ctx, dim: int):
    """``grouped_queries``' inverse for the context [batch, rows, pack * group, pack * head_dim]:
    each head's own block, [batch, 1, heads, head_dim]."""
    batch, rows, width = ctx.shape[0], ctx.shape[1], ctx.shape[-1]
    pack = width // dim
    if pack == 1:
        return ctx.reshape(batch, 1, -1, dim)
    ctx = ctx.reshape(batch, rows, pack, -1, pack, dim)
    ctx = jnp.einsum("bjhgxd,hx->bjhgd", ctx, jnp.eye(pack, dtype=ctx.dtype))
    return ctx.reshape(batch, 1, -1, dim)


def one_query_attention(q, k, v, mask, scale, keys_t: bool = False):
    """Attention of one new token per row over the cache (a decoding step), the cache read in its
    own layout (``KV_CACHE_AXES``, ``packed``): batch and kv heads lead, so both products are
    batched matmuls with no transpose of the cache. Scores and softmax in float32. A row of a
    packed cache holds ``pack`` kv heads: their query heads are laid block-diagonally over its
    features (``grouped_queries``), and each head's context taken from its own block.

    q: [batch, 1, heads, head_dim]; k, v: [batch, kv_heads / pack, k_len, pack * head_dim]
    (``keys_t``: k [batch, kv_heads / pack, pack * head_dim, k_len], ``keys_transposed``);
    mask: bool [batch, 1, 1, k_len]. Returns [batch, 1, heads, head_dim]. The Pallas kernel of
    the same step: ``models/decode_attention.py``.
    """
    dim = q.shape[-1]
    rows, pack = v.shape[1], v.shape[-1] // dim
    q = grouped_queries(q * jnp.asarray(scale, q.dtype), rows, pack)
    scores = jnp.einsum("bjrx,bjxm->bjrm" if keys_t else "bjrx,bjmx->bjrm", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, :, 0, None, :], scores, jnp.finfo(jnp.float32).min)  # [batch, rows, pack*group, k_len]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return own_heads(jnp.einsum("bjrm,bjmx->bjrx", probs, v), dim)
