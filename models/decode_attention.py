"""A Pallas TPU kernel for one decoding query per row over the KV cache (``execution.decode_attention``).

``one_query_pallas`` computes what ``attention_kernels.one_query_attention`` does (and soft-capped
logits), with the cache left in HBM: its blocks of positions are moved into on-chip memory by
the kernel's own pipeline, and only the blocks from the first the query may see (its window or
chunk) to the one holding the query's slot: the block index map clamps the rest onto those
two, so they are neither fetched again nor computed (``pl.when``). The softmax runs online over
the blocks, its statistics in float32. A batch row's query heads meet all its kv rows' keys of
a block in one matmul, each head's scores outside its own kv row masked (GQA/MQA); a packed
cache row (``kv_pack``: 128 // head_dim kv heads side by side) meets its query heads
block-diagonally (``grouped_queries``), as in the XLA path.

Why: XLA's memory-space assignment staged each layer's whole cache in on-chip memory around the
step's one-position write and copied it back, and its attention read every slot of the cache
(BENCHMARKS.md, the TPU decoding sections); a Pallas call's operands stay in HBM.

Scanned decoding hands it a stack's keys and values whole with the layer's index (``layer``,
scalar-prefetched; models/decode.py ``split_kv``), so no layer's cache is sliced out of the stack.

The mask is the XLA path's own (``attention_mask``: causality, windows, chunks, a left-padded
row's segments), read per block beside the cache; the window and chunk only narrow which blocks
are read. ``kernel_for`` chooses, in one place, which layers run it: not attention sinks, ALiBi,
differential attention, values narrower than the keys or keys another layer reads (those stay
in XLA), only on one device (a Pallas call has no GSPMD partitioning) and for caches with a block
(``block_k``); ``wants_kernel`` resolves "auto" (the default) to where the chip measured it faster.
Off a TPU it runs in Pallas' interpret mode (tests; slow).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from shardzoo.models.attention_kernels import grouped_queries, own_heads

MAX_BLOCK = 512  # positions per block at most (``block_k``)
BLOCK_BYTES = 2 << 20  # keys and values of one grid step (both buffered twice in on-chip memory)
_LANES = 128
_NEG = float(jnp.finfo(jnp.float32).min)
AUTO_MIN_BATCH = 8  # decode_attention "auto": the kernel from this batch (v5e: 0.99x at 1, 1.15-1.48x at 32)
# ... and for caches of at most this many kv rows (as measured: qwen3-0.6b 8, llama3.2-1b 4 packed): every
# query head meets every kv row's keys (``_kernel``), so a many-headed MHA cache multiplies the step's work
AUTO_MAX_KV_ROWS = 8


def wants_kernel(execution, batch: int, kv_rows: int | None = None) -> bool:
    """``execution.decode_attention`` resolved for a call of ``batch`` rows over a cache of
    ``kv_rows`` (None: not known yet): "pallas", or "auto" on a TPU with scanned decoding layers,
    at least AUTO_MIN_BATCH rows and at most AUTO_MAX_KV_ROWS kv rows."""
    mode = execution.decode_attention
    if mode == "auto":
        return (jax.default_backend() == "tpu" and execution.decode_layers == "scan"
                and batch >= AUTO_MIN_BATCH and (kv_rows is None or kv_rows <= AUTO_MAX_KV_ROWS))
    return mode == "pallas"


def reads_stack(execution, length: int, placement, batch: int, kv_rows: int | None = None) -> bool:
    """Whether scanned decoding hands each attention layer the stack's keys and values whole and
    its index in them (models/decode.py ``split_kv``): where the kernel is wanted
    (``wants_kernel``), the call decodes one token and the program runs on one device; so no
    layer's cache is sliced out of the stack (a copy of it), the kernel reading its own in place."""
    one_device = placement is None or placement.mesh.size == 1
    return wants_kernel(execution, batch, kv_rows) and length == 1 and one_device


def kernel_for(execution, *, length: int, batch: int, unserved: bool, placement, cache_length: int,
               keys_t: bool, kv_rows: int | None = None) -> str:
    """"pallas" or "xla" for a decoding call of ``length`` tokens and ``batch`` rows over a cache
    of ``kv_rows``: "pallas" where ``reads_stack`` (the kernel wanted, one token, one device), the
    layer has nothing the kernel lacks (``unserved``: it has) and the cache's length has a block
    (``block_k``)."""
    ok = reads_stack(execution, length, placement, batch, kv_rows) and not unserved
    return "pallas" if ok and block_k(cache_length, keys_t) else "xla"


def cache_kv_rows(cache) -> int | None:
    """The most kv rows of any attention cache in ``cache`` (its values' ``[..., rows, length,
    width]``); None where it holds none."""
    rows = [leaf.shape[-3] for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]
            if getattr(path[-1], "key", None) == "cached_value"]
    return max(rows, default=None)


def block_k(length: int, keys_t: bool = False) -> int | None:
    """Positions per block of a cache of ``length``: 128 (a TPU's lanes) where it divides, else
    the largest multiple of 16 (a bfloat16 tile's rows) up to MAX_BLOCK that does, else the whole
    cache up to MAX_BLOCK; transposed keys (positions on the lanes) take 128 or the whole cache.
    None: no block fits."""
    if length % 128 == 0:
        return 128
    fits = [b for b in range(16, MAX_BLOCK + 1, 16) if length % b == 0 and not keys_t]
    return fits[-1] if fits else (length if length <= MAX_BLOCK else None)


def block_b(batch: int, rows: int, block: int, width: int, itemsize: int, block_bytes: int = BLOCK_BYTES) -> int:
    """Batch rows per grid step: the most dividing ``batch`` whose keys and values of a block fit
    ``block_bytes`` (at least one): fewer, larger steps, each step's fixed cost ~0.35 us on a TPU."""
    per_row = 2 * rows * block * width * itemsize
    return max([b for b in range(1, batch + 1) if batch % b == 0 and b * per_row <= block_bytes] or [1])


def block_bounds(index, block: int, window=None, chunk=None):
    """int32 [3]: the first and last blocks the query at slot ``index`` may see, and ``index``
    (the kernel's scalars; a stack's layer a fourth).
    Only needs to be no later than the mask's first visible slot (the mask is exact)."""
    start = jnp.int32(0)
    if window:
        start = jnp.maximum(start, index - window + 1)
    if chunk:
        start = jnp.maximum(start, index // chunk * chunk)
    return jnp.stack([start // block, index // block, index]).astype(jnp.int32)


def _kernel(bounds, q_ref, k_ref, v_ref, valid_ref, o_ref, m_ref, l_ref, acc_ref, *, block, keys_t, cap, group):
    """One grid step: batch rows ``program_id(0)``, cache block ``program_id(1)``. q [bb, heads,
    width] (a row's query heads, ``group`` a kv row, then zero rows to a whole tile); k, v [bb,
    kv rows, block, width] (k [bb, rows, width, block] where ``keys_t``); valid [bb, 1, block];
    m, l [bb, heads, 128] and acc [bb, heads, width] float32 across blocks.

    A batch row's kv rows are one matrix of ``rows * block`` positions: one matmul of every query
    head against all of them, the columns of other kv rows masked (``own``), then one matmul of
    the probabilities against the values; so a step is two matmuls a batch row, not two a kv row
    (the MXU's fixed cost per matmul, not its width, is what a one-query step pays)."""
    kb = pl.program_id(1)
    first, last, index = bounds[0], bounds[1], bounds[2]
    rows, width = v_ref.shape[1], v_ref.shape[-1]
    heads, n = q_ref.shape[1], rows * block
    own = (jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (heads, n), 0), group)
           == jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (heads, n), 1), block))

    @pl.when(kb == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def attend(holds_query):
        def row(b, carry):
            q = q_ref[b]
            if keys_t:  # [width, rows * block]: the kv rows side by side on the lanes
                k = jnp.concatenate([k_ref[b, j] for j in range(rows)], axis=1)
            else:
                k = k_ref[b].reshape(n, width)
            v = v_ref[b].reshape(n, width)
            s = jax.lax.dot_general(q, k, (((1,), (0 if keys_t else 1,)), ((), ())),
                                    preferred_element_type=jnp.float32)  # [heads, rows * block]
            if cap:
                s = cap * jnp.tanh(s / cap)
            valid = jnp.tile(valid_ref[b], (1, rows)) != 0  # [1, rows * block]
            s = jnp.where(own & valid, s, _NEG)
            m_prev = m_ref[b]
            m_next = jnp.maximum(m_prev, s.max(axis=-1)[:, None])  # [heads, 128]
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - _lanes(m_next, n))
            l_ref[b] = alpha * l_ref[b] + jax.lax.broadcast_in_dim(p.sum(axis=-1), m_prev.shape, (0,))
            m_ref[b] = m_next
            if holds_query:  # the slots past the query's are unwritten (anything, NaN too): 0 * NaN is NaN
                slot = kb * block + jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, v.shape, 0), block)
                v = jnp.where(slot <= index, v.astype(jnp.float32), 0.0).astype(v.dtype)  # (a 32-bit select)
            pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            acc_ref[b] = _lanes(alpha, width) * acc_ref[b] + pv
            return carry

        jax.lax.fori_loop(0, v_ref.shape[0], row, 0)

    pl.when((kb >= first) & (kb < last))(lambda: attend(False))
    pl.when(kb == last)(lambda: attend(True))

    @pl.when(kb == pl.num_programs(1) - 1)
    def _out():
        def row(b, carry):
            o_ref[b] = (acc_ref[b] / _lanes(l_ref[b], width)).astype(o_ref.dtype)
            return carry

        jax.lax.fori_loop(0, o_ref.shape[0], row, 0)


def _lanes(x, n: int):
    """Per-row statistics [r, 128] (each row's value on every lane) as [r, n], as splash widens them."""
    if n % _LANES == 0:
        return jnp.tile(x, (1, n // _LANES))
    return x[:, :n] if n < _LANES else x[:, :1]


def one_query_pallas(q, k, v, mask, index, scale, *, keys_t: bool = False, window=None, chunk=None, logit_cap=None,
                     layer=None, block=None, batch_block=None, block_bytes=BLOCK_BYTES, interpret=None):
    """``one_query_attention`` (shapes and ``keys_t`` as there) by the Pallas kernel; ``index``:
    the query's cache slot (int32 scalar, every row's), ``window``/``chunk`` what the mask holds
    (only to skip blocks), ``logit_cap`` the soft-cap of the scaled logits. ``layer``: k and v
    are a scanned stack's, a leading layers axis, and this layer's is read in place (int32
    scalar). ``block`` positions and ``batch_block`` rows per grid step (None: ``block_k``,
    ``block_b`` of ``block_bytes``). ``interpret``: None runs Pallas' interpreter anywhere but on a TPU."""
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    batch, _, heads, dim = q.shape
    rows, length, width = v.shape[-3:]
    block = block or block_k(length, keys_t)
    bb = batch_block or block_b(batch, rows, block, width, v.dtype.itemsize, block_bytes)
    qg = grouped_queries(q * jnp.asarray(scale, q.dtype), rows, width // dim)  # [batch, rows, r, width]
    r = qg.shape[2]
    sublanes = 32 // q.dtype.itemsize  # a full tile of rows (8 float32, 16 bfloat16): zero queries pad it
    hp = -(-rows * r // sublanes) * sublanes
    qg = jnp.pad(qg.reshape(batch, rows * r, width), ((0, 0), (0, hp - rows * r), (0, 0)))  # [batch, hp, width]
    valid = mask.astype(jnp.int32).reshape(batch, length // block, 1, block)  # a block's on the lanes, whole
    bounds = block_bounds(jnp.asarray(index, jnp.int32), block, window, chunk)
    stacked = layer is not None
    if stacked:
        bounds = jnp.concatenate([bounds, jnp.asarray(layer, jnp.int32)[None]])

    def seen(kb, bounds):  # blocks before the first or past the last repeat them: not fetched again
        return jnp.minimum(jnp.maximum(kb, bounds[0]), bounds[1])

    def cache_spec(shape, at):  # a stack's layer (bounds[3]) squeezed out
        if not stacked:
            return pl.BlockSpec(shape, at)
        return pl.BlockSpec((None,) + shape, lambda b, kb, bounds: (bounds[3],) + at(b, kb, bounds))

    rows_spec = pl.BlockSpec((bb, hp, width), lambda b, kb, bounds: (b, 0, 0))
    k_spec = (cache_spec((bb, rows, width, block), lambda b, kb, bounds: (b, 0, 0, seen(kb, bounds))) if keys_t
              else cache_spec((bb, rows, block, width), lambda b, kb, bounds: (b, 0, seen(kb, bounds), 0)))
    v_spec = cache_spec((bb, rows, block, width), lambda b, kb, bounds: (b, 0, seen(kb, bounds), 0))
    valid_spec = pl.BlockSpec((bb, None, 1, block), lambda b, kb, bounds: (b, seen(kb, bounds), 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(batch // bb, length // block),
        in_specs=[rows_spec, k_spec, v_spec, valid_spec], out_specs=rows_spec,
        scratch_shapes=[pltpu.VMEM((bb, hp, _LANES), jnp.float32)] * 2 + [pltpu.VMEM((bb, hp, width), jnp.float32)])
    out = pl.pallas_call(
        functools.partial(_kernel, block=block, keys_t=keys_t, cap=logit_cap, group=r),
        grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(bounds, qg, k, v, valid)
    return own_heads(out[:, :rows * r].reshape(batch, rows, r, width), dim)  # [batch, 1, heads, head_dim]
