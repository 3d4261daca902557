"""One decoding step's write into the KV cache, in place, by a Pallas kernel on a TPU.

``jax.lax.dynamic_update_slice`` of one position into a layer's cache [batch, kv_rows,
cache_length, width] (``attention_kernels.KV_CACHE_AXES``) is in place in XLA's terms, but a TPU
compiler that has already staged the cache in its on-chip memory for the step's attention does
the write there and then copies the whole cache back: measured on a v5e, qwen3-0.6b at batch 32
spent 13.6% of every step on those copies (plus their reads), and the step ran at 58% of the
bandwidth bound. The kernel here reads and writes one tile of rows around the position
(``rows_per_tile`` for the dtype) per batch block, its output aliased to the cache: the write
touches only that tile in memory, whatever the attention reads.

``kv_cache_write`` (``ModelConfig.execution``): "auto" uses the kernel on a TPU for one-token
steps of unrolled decoding layers (a scanned stack's slice is not its own buffer) whose cache
length is a multiple of the tile; "kernel" anywhere (Pallas' interpreter off a TPU: tests);
"dus" never. Under a mesh, the kernel runs per device in a ``shard_map`` over the mesh axes
that hold batch and kv heads.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from shardzoo.models.ring_attention import other_axes, spec_of
from shardzoo.sharding import axes as ax

# the bytes of one batch block's tile of rows (its input and output double-buffered in VMEM)
_BLOCK_BYTES = 1 << 20


def rows_per_tile(dtype) -> int:
    """Rows of a TPU tile for ``dtype``: 8 of 32 bits, 16 of bf16 (two rows per sublane), 32 of 8 bits."""
    return 32 // jnp.dtype(dtype).itemsize


def uses_kernel(execution, length: int, cache_length: int, dtype) -> bool:
    """Whether a write of ``length`` positions into a cache of ``cache_length`` goes through the kernel."""
    mode = execution.kv_cache_write
    fits = length == 1 and cache_length % rows_per_tile(dtype) == 0
    if mode == "kernel":
        return fits
    return (mode == "auto" and fits and execution.decode_layers == "unroll"
            and jax.default_backend() == "tpu")


def _kernel(index_ref, new_ref, cache_ref, out_ref):
    rows = out_ref.shape[2]
    slot = jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 2)
    out_ref[...] = jnp.where(slot == index_ref[0] % rows, new_ref[...], cache_ref[...])


def _write(cache, new, index, *, interpret: bool):
    batch, kv_rows, cache_length, width = cache.shape
    rows = rows_per_tile(cache.dtype)
    per_row = kv_rows * rows * width * cache.dtype.itemsize
    block = max([b for b in range(1, batch + 1) if batch % b == 0 and b * per_row <= _BLOCK_BYTES] or [1])
    tile = (block, kv_rows, rows, width)
    return pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch // block,),
            in_specs=[pl.BlockSpec((block, kv_rows, 1, width), lambda b, i: (b, 0, 0, 0)),
                      pl.BlockSpec(tile, lambda b, i: (b, 0, i[0] // rows, 0))],
            out_specs=pl.BlockSpec(tile, lambda b, i: (b, 0, i[0] // rows, 0)),
        ),
        input_output_aliases={2: 0},  # (the scalar index is input 0)
        interpret=interpret,
    )(jnp.reshape(index, (1,)).astype(jnp.int32), new.astype(cache.dtype), cache)


def write_position(cache, new, index, placement=None, interpret=None):
    """``cache`` [batch, kv_rows, cache_length, width] with ``new`` [batch, kv_rows, 1, width] at
    position ``index`` (a traced scalar): ``dynamic_update_slice``'s result, written in place by
    the kernel. ``interpret`` None: Pallas' interpreter anywhere but on a TPU."""
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    fn = functools.partial(_write, interpret=interpret)
    if placement is None or math.prod(placement.sizes.values()) == 1:
        return fn(cache, new, index)
    batch_axes = other_axes(placement, ax.BATCH, (cache.shape[0],), ())
    head_axes = other_axes(placement, ax.KV_HEADS, (cache.shape[1],), batch_axes)
    spec = spec_of(batch_axes, head_axes, None, None)
    return jax.shard_map(fn, mesh=placement.mesh, in_specs=(spec, spec, spec_of()), out_specs=spec,
                         check_vma=False)(cache, new, index)
