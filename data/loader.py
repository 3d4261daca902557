"""The per-process batch iterator and ``make_datasets``, the one call the trainer makes."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from shardzoo.data.chat import tokenize_chats
from shardzoo.data.errors import DataError
from shardzoo.data.labelled import LabelledRows, encode_labels, read_examples
from shardzoo.data.packing import (
    pack_conversations,
    pack_documents,
    pack_examples,
    split_documents,
    split_indices,
    tokenize_documents,
    tokenize_examples,
)
from shardzoo.data.sources import STDLIB, check_text_column, load_source
from shardzoo.data.tokenizer import BYTE_SPEC, load_tokenizer
from shardzoo.sharding import axes as ax
from shardzoo.sharding.partition import spec_to_sharding


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the data comes from and how it becomes rows (see ``sources.py`` for spec syntax)."""

    data: str = STDLIB  # local file / glob / directory, "stdlib", or hub:NAME[:CONFIG][@SPLIT]
    text_column: str = "text"
    prompt_column: str | None = None  # with completion_column: fine-tuning rows, loss on completion
    completion_column: str | None = None
    chat_column: str | None = None  # conversations rendered with the chat template, loss on assistant turns
    eval_data: str | None = None  # a held-out data spec; or eval_fraction of the documents
    eval_fraction: float = 0.0
    tokenizer: str = BYTE_SPEC  # "byte", a tokenizer.json, or an HF model directory
    add_bos: bool = False  # start every document with bos
    cache_dir: str | None = None  # datasets' cache (default: HF_DATASETS_CACHE)
    label_column: str | None = None  # given: labelled examples (make_labelled_datasets)
    feature_columns: tuple[str, ...] | None = None  # None: every column except the label

    @property
    def examples(self) -> bool:
        """True for prompt/completion rows, False for packed documents."""
        return self.prompt_column is not None

    @property
    def chat(self) -> bool:
        """True for conversations (a list of {role, content} messages per row)."""
        return self.chat_column is not None

    @property
    def labelled(self) -> bool:
        """True for examples of features and a label (no tokenizer, no text)."""
        return self.label_column is not None


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


def _documents(spec: str, config: DataConfig, tokenizer):
    ds = load_source(spec, cache_dir=config.cache_dir)
    if config.chat:
        if config.chat_column not in ds.column_names:
            raise DataError(f"data {spec!r} has no column {config.chat_column!r} (--chat-column); "
                            f"its columns are: {', '.join(ds.column_names)}")
        docs = tokenize_chats(ds, tokenizer, config.chat_column, config.add_bos)
    elif config.examples:
        check_text_column(ds, config.prompt_column, spec, "--prompt-column")
        check_text_column(ds, config.completion_column, spec, "--completion-column")
        docs = tokenize_examples(
            ds, tokenizer, config.prompt_column, config.completion_column, config.add_bos
        )
    else:
        check_text_column(ds, config.text_column, spec)
        docs = tokenize_documents(ds, tokenizer, config.text_column, config.add_bos)
    if len(docs) == 0:
        raise DataError(f"data {spec!r}: empty dataset (all {len(ds)} rows have no text)")
    return docs


def _packer(config: DataConfig):
    """How ``config``'s documents become rows: conversations, examples, or packed documents."""
    return pack_conversations if config.chat else pack_examples if config.examples else pack_documents


def _check_eval_split(config: DataConfig) -> None:
    if not 0.0 <= config.eval_fraction < 1.0:
        raise DataError(f"--eval-fraction must be in [0, 1), got {config.eval_fraction}")
    if config.eval_data and config.eval_fraction:
        raise DataError("give --eval-data or --eval-fraction, not both")


def make_datasets(
    config: DataConfig,
    tokenizer,
    seq_len: int,
    global_batch_size: int,
    mesh=None,
    rules=None,
    seed: int = 0,
    process_index: int | None = None,
    process_count: int | None = None,
):
    """(train iterator, eval iterator or None) over ``config``'s data; see ``data/__init__.py``."""
    if config.labelled:
        raise ValueError("make_datasets: a config with label_column goes to make_labelled_datasets")
    if (config.prompt_column is None) != (config.completion_column is None):
        raise DataError("--prompt-column and --completion-column must be given together")
    if config.chat and config.examples:
        raise DataError("--chat-column cannot be combined with --prompt-column/--completion-column")
    _check_eval_split(config)
    tokenizer = load_tokenizer(config.tokenizer) if tokenizer is None else tokenizer

    train_docs = _documents(config.data, config, tokenizer)
    eval_docs = None
    if config.eval_data:
        eval_docs = _documents(config.eval_data, config, tokenizer)
    elif config.eval_fraction:
        if len(train_docs) < 2:
            raise DataError(
                f"data {config.data!r} has {len(train_docs)} document: --eval-fraction needs at "
                "least 2 (text files are one document each); give --eval-data instead"
            )
        train_docs, eval_docs = split_documents(train_docs, config.eval_fraction, seed)

    pack = _packer(config)
    train_rows = pack(train_docs, seq_len, tokenizer.pad_id)
    if config.chat and not train_rows.loss_mask.any():
        where = (f"within the first --seq-len {seq_len} tokens of any conversation"
                 if train_docs.loss_mask.any() else "in any conversation")
        raise DataError(f"data {config.data!r}: no assistant token {where} of --chat-column "
                        f"{config.chat_column}, so nothing to train on")
    if config.chat and len(train_rows) < global_batch_size:
        raise DataError(
            f"data {config.data!r}: {len(train_docs)} conversations pack into {len(train_rows)} "
            f"rows of {seq_len} tokens, fewer than one global batch of {global_batch_size}")
    if config.examples and len(train_docs) < global_batch_size:
        raise DataError(
            f"data {config.data!r}: {len(train_docs)} examples, fewer than one global batch "
            f"of {global_batch_size}"
        )
    if not (config.examples or config.chat) and len(train_docs.tokens) < global_batch_size * seq_len:
        raise DataError(
            f"data {config.data!r}: {len(train_docs.tokens)} tokens ({len(train_docs)} documents, "
            f"tokenizer {tokenizer.spec}), fewer than one global batch of {global_batch_size} x "
            f"{seq_len} = {global_batch_size * seq_len} tokens"
        )
    common = dict(mesh=mesh, rules=rules, process_index=process_index, process_count=process_count)
    train = BatchIterator(
        train_rows,
        global_batch_size,
        seed=seed,
        shuffle=True,
        repeat=True,
        **common,
    )
    evaluation = None
    if eval_docs is not None:
        evaluation = BatchIterator(
            pack(eval_docs, seq_len, tokenizer.pad_id),
            global_batch_size,
            seed=seed,
            shuffle=False,
            repeat=False,
            **common,
        )
    return train, evaluation


def make_eval_dataset(
    config: DataConfig,
    tokenizer,
    seq_len: int,
    global_batch_size: int,
    *,
    split: str = "all",
    seed: int = 0,
    mesh=None,
    rules=None,
    process_index: int | None = None,
    process_count: int | None = None,
) -> BatchIterator:
    """One in-order pass over the rows of ``config.data`` (``split="all"``), or of the documents
    that ``make_datasets`` trains on (``"train"``) or holds out (``"eval"``) under
    ``config.eval_fraction`` and ``seed``; the last batch is filled up with rows of weight 0."""
    if split not in ("all", "train", "eval"):
        raise DataError(f"--split {split!r}: expected all, train or eval")
    if split != "all" and not 0.0 < config.eval_fraction < 1.0:
        raise DataError(f"--split {split} needs the --eval-fraction in (0, 1) the run held out")
    tokenizer = load_tokenizer(config.tokenizer) if tokenizer is None else tokenizer
    docs = _documents(config.data, config, tokenizer)
    if split != "all":
        if len(docs) < 2:
            raise DataError(f"data {config.data!r} has {len(docs)} document: nothing to split")
        docs = split_documents(docs, config.eval_fraction, seed)[split == "eval"]
    return BatchIterator(_packer(config)(docs, seq_len, tokenizer.pad_id), global_batch_size, seed=seed,
                         shuffle=False, repeat=False, mesh=mesh, rules=rules,
                         process_index=process_index, process_count=process_count)


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


def make_labelled_datasets(
    config: DataConfig,
    global_batch_size: int,
    mesh=None,
    rules=None,
    seed: int = 0,
    process_index: int | None = None,
    process_count: int | None = None,
):
    """(train iterator, eval iterator or None) over ``config``'s labelled examples (features and
    ``config.label_column``); see ``data/__init__.py``."""
    if not config.labelled:
        raise ValueError("make_labelled_datasets: the config has no label_column")
    if config.examples or config.completion_column is not None or config.chat:
        raise DataError("--label-column cannot be combined with --prompt-column/--completion-column"
                        "/--chat-column")
    _check_eval_split(config)
    label = config.label_column
    columns = None if config.feature_columns is None else tuple(config.feature_columns)
    specs = [config.data] + ([config.eval_data] if config.eval_data else [])
    features, raw = [], []
    for spec in specs:
        ds = load_source(spec, cache_dir=config.cache_dir)
        # Eval data is read by the train data's feature columns, in their order.
        columns, x, y = read_examples(ds, spec, label, columns)
        if features and x.shape[1] != features[0].shape[1]:
            raise DataError(
                f"data {spec!r} has {x.shape[1]} features per example but {specs[0]!r} has "
                f"{features[0].shape[1]} (columns {', '.join(columns)})"
            )
        features.append(x)
        raw.append(y)
    targets, num_classes, names = encode_labels(raw, specs, label)
    splits = [
        LabelledRows(x, y, num_classes, names) for x, y in zip(features, targets, strict=True)
    ]
    train = splits[0]
    evaluation = splits[1] if config.eval_data else None
    if config.eval_fraction:
        if len(train) < 2:
            raise DataError(
                f"data {config.data!r} has {len(train)} example: --eval-fraction needs at least 2"
            )
        kept, held_out = split_indices(len(train), config.eval_fraction, seed)
        train, evaluation = train.select(kept), train.select(held_out)
    if len(train) < global_batch_size:
        raise DataError(
            f"data {config.data!r}: {len(train)} examples, fewer than one global batch "
            f"of {global_batch_size}"
        )
    common = dict(mesh=mesh, rules=rules, process_index=process_index, process_count=process_count)
    train_iter = LabelledBatchIterator(
        train, global_batch_size, seed=seed, shuffle=True, repeat=True, **common
    )
    eval_iter = None
    if evaluation is not None:
        eval_iter = LabelledBatchIterator(
            evaluation, global_batch_size, seed=seed, shuffle=False, repeat=False, **common
        )
    return train_iter, eval_iter
