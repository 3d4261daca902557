"""The per-process batch iterator: rows shuffled per epoch, split across processes, placed as
global ``jax.Array``s under the rules, and resumable from a JSON position."""

from __future__ import annotations

import math

import jax
import numpy as np

from shardzoo.data.errors import DataError
from shardzoo.sharding import axes as ax
from shardzoo.sharding.partition import spec_to_sharding


def _local_indices(sharding, global_shape) -> tuple[np.ndarray, ...]:
    """Per dimension, the global indices this process's devices hold, in the order
    ``jax.make_array_from_process_local_data`` expects them in the local array."""
    spans = [set() for _ in global_shape]
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        for dim, (s, size) in enumerate(zip(index, global_shape, strict=True)):
            spans[dim].add(s.indices(size)[:2])
    return tuple(np.concatenate([np.arange(a, b) for a, b in sorted(s)]) for s in spans)


def _num_shards(sharding, dim: int) -> int:
    spec = tuple(sharding.spec) + (None,) * (dim + 1)
    names = spec[dim] or ()
    names = (names,) if isinstance(names, str) else names
    return math.prod(sharding.mesh.shape[n] for n in names)


_DIM_NAMES = {ax.BATCH: "global batch size", ax.LENGTH: "sequence length"}


class BatchIterator:
    """Batches of rows: shuffled per epoch by seed, split across processes, resumable.

    ``rows`` is any row set with ``len``, ``shapes`` (one row's shape per batch key), ``axes``
    (each key's logical axes, the batch first) and ``batch(indices) -> dict`` (index -1: a
    fill-up row of weight 0): packed token rows (``packing.Rows``) or labelled examples
    (``labelled.LabelledRows``). Each ``next`` gives the batch of the next ``global_batch_size``
    rows: global ``jax.Array`` s placed by ``spec_to_sharding(axes[key], mesh, rules)`` when
    ``mesh`` is given, else this process's rows as numpy. The last batch of an epoch is filled
    up with rows of weight 0, so each epoch yields every row once. With ``repeat=False`` (eval)
    one pass ends with StopIteration and the iterator rewinds, so each ``for`` loop is one pass.
    """

    def __init__(
        self,
        rows,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        repeat: bool = True,
        mesh=None,
        rules=None,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        self._placement = dict(mesh=mesh, rules=rules, process_index=process_index,
                               process_count=process_count)
        self.rows, self.global_batch_size = rows, global_batch_size
        self.shuffle, self.repeat = shuffle, repeat
        self.seed, self.epoch, self.position = int(seed), 0, 0  # position: rows done this epoch
        self.global_shapes = {k: (global_batch_size, *s) for k, s in rows.shapes.items()}
        self.shardings = None
        self._local_rows, self._local_slices = None, {}  # slices: other dims a process holds part of
        if mesh is not None:
            if rules is None:
                raise ValueError("BatchIterator: a mesh needs rules to place the batch")
            self.shardings = {k: spec_to_sharding(a, mesh, rules) for k, a in rows.axes.items()}
            for key, sharding in self.shardings.items():
                self._check_divisible(key, sharding)
                local = _local_indices(sharding, self.global_shapes[key])
                if self._local_rows is None:
                    self._local_rows = local[0]
                if not np.array_equal(local[0], self._local_rows):  # one batch axis for all keys
                    raise ValueError(f"BatchIterator: {key!r} splits the batch unlike the others")
                for dim, held in enumerate(local[1:], 1):
                    if len(held) < self.global_shapes[key][dim]:
                        self._local_slices.setdefault(key, []).append((dim, held))
        else:
            index = jax.process_index() if process_index is None else process_index
            count = jax.process_count() if process_count is None else process_count
            if global_batch_size % count:
                raise DataError(
                    f"global batch size {global_batch_size} is not divisible by {count} processes"
                )
            per_process = global_batch_size // count
            self._local_rows = np.arange(index * per_process, (index + 1) * per_process)
        self._order_cache = (None, None)

    def _check_divisible(self, key: str, sharding) -> None:
        shape, names = self.global_shapes[key], self.rows.axes[key]
        for dim, size in enumerate(shape):
            shards = _num_shards(sharding, dim)
            if size % shards:
                what = _DIM_NAMES.get(names[dim], f"dimension {dim} of {key!r}")
                raise DataError(
                    f"{what} {size} is not divisible by its {shards} shards "
                    f"(mesh axes {sharding.spec[dim]} of the batch sharding {sharding.spec})"
                )

    def with_rows(self, rows, *, in_order: bool = False) -> BatchIterator:
        """An iterator like this one (placement, seed, position) over ``rows`` (as many, with
        more entries, e.g. stored reference log-probs); ``in_order``: one unshuffled pass."""
        other = type(self)(rows, self.global_batch_size, seed=self.seed, shuffle=self.shuffle and not in_order,
                           repeat=self.repeat and not in_order, **self._placement)
        if not in_order:
            other.restore(self.state())
        return other

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self.rows) // self.global_batch_size)

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache[0] != (self.seed, epoch):
            order = np.arange(len(self.rows))
            if self.shuffle:
                order = np.random.default_rng([self.seed, 2, epoch]).permutation(len(self.rows))
            self._order_cache = ((self.seed, epoch), order)
        return self._order_cache[1]

    def __iter__(self):
        return self

    def __next__(self):
        if self.position >= len(self.rows):
            self.position = 0
            if not self.repeat:
                raise StopIteration
            self.epoch += 1
        indices = self._order(self.epoch)[self.position : self.position + self.global_batch_size]
        self.position += len(indices)
        indices = np.pad(indices, (0, self.global_batch_size - len(indices)), constant_values=-1)
        local = self.rows.batch(indices[self._local_rows])
        for key, slices in self._local_slices.items():
            for dim, held in slices:
                local[key] = np.take(local[key], held, axis=dim)
        if self.shardings is None:
            return local
        # one hand-off of the whole batch (a pytree of arrays, shardings and global shapes)
        return jax.make_array_from_process_local_data(self.shardings, local, self.global_shapes)

    def state(self) -> dict:
        """A JSON-able position: restoring it makes the next batches those this iterator gives next."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "num_rows": len(self.rows),
        }

    def restore(self, state: dict) -> None:
        """Continue from a ``state()`` (its seed included); the data must have as many rows."""
        if state.get("num_rows") != len(self.rows):
            raise DataError(
                f"the saved data iterator was over {state.get('num_rows')} rows but this data has "
                f"{len(self.rows)}: the data (or its tokenizer, seq_len or split) changed since "
                "the checkpoint"
            )
        self.seed, self.epoch, self.position = (
            int(state["seed"]),
            int(state["epoch"]),
            int(state["position"]),
        )


class LabelledBatchIterator(BatchIterator):
    """A ``BatchIterator`` over ``LabelledRows`` that tells what the model must take and give."""

    @property
    def task(self) -> str:
        """``"classification"`` or ``"regression"``."""
        return self.rows.task

    @property
    def num_features(self) -> int:
        return self.rows.num_features

    @property
    def num_classes(self) -> int | None:
        return self.rows.num_classes

    @property
    def num_outputs(self) -> int:
        return self.rows.num_outputs

    @property
    def label_names(self) -> tuple[str, ...] | None:
        return self.rows.label_names
