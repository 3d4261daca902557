"""``make_datasets`` (the one call the trainer makes), ``make_eval_dataset`` and
``make_labelled_datasets``: data specs to ``BatchIterator``s (``batches.py``)."""

from __future__ import annotations

import dataclasses

from shardzoo.data.batches import BatchIterator, LabelledBatchIterator
from shardzoo.data.chat import tokenize_chats
from shardzoo.data.errors import DataError
from shardzoo.data.labelled import LabelledRows, encode_labels, read_examples
from shardzoo.data.packing import (
    Documents,
    Rows,
    pack_conversations,
    pack_documents,
    pack_examples,
    split_documents,
    split_indices,
    tokenize_documents,
    tokenize_examples,
)
from shardzoo.data.preference import kl_pairs, pack_pairs, tokenize_pairs, tokenize_unpaired
from shardzoo.data.sources import STDLIB, check_text_column, load_source, without_missing
from shardzoo.data.tokenizer import BYTE_SPEC, load_tokenizer


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
    skip_missing: bool = False  # rows with a null text/prompt/completion: skipped and counted, not refused
    preference: bool = False  # prompt/chosen/rejected pairs (DPO and its variants; preference.py)
    unpaired: bool = False  # with preference: prompt/completion/label rows (KTO), each with its mismatched pair
    max_prompt_length: int | None = None  # pairs: keep the prompt's last N tokens
    max_completion_length: int | None = None  # pairs: keep each completion's first N tokens

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
        ds = without_missing(ds, (config.prompt_column, config.completion_column), spec, config.skip_missing)
        docs = tokenize_examples(
            ds, tokenizer, config.prompt_column, config.completion_column, config.add_bos
        )
    else:
        check_text_column(ds, config.text_column, spec)
        ds = without_missing(ds, (config.text_column,), spec, config.skip_missing)
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


@dataclasses.dataclass(frozen=True)
class SplitRows:
    """The documents of the train and eval splits and the rows they pack into (eval None
    without eval data): what ``make_datasets`` batches and ``shardzoo data`` shows."""

    train_docs: Documents
    train_rows: Rows
    eval_docs: Documents | None
    eval_rows: Rows | None


def split_rows(config: DataConfig, tokenizer, seq_len: int, seed: int = 0) -> SplitRows:
    """Tokenize ``config``'s data, hold out its eval split and pack both into rows, as training does."""
    if config.labelled:
        raise ValueError("split_rows: a config with label_column goes to make_labelled_datasets")
    if (config.prompt_column is None) != (config.completion_column is None):
        raise DataError("--prompt-column and --completion-column must be given together")
    if config.chat and config.examples:
        raise DataError("--chat-column cannot be combined with --prompt-column/--completion-column")
    _check_eval_split(config)
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
    return SplitRows(train_docs, pack(train_docs, seq_len, tokenizer.pad_id), eval_docs,
                     None if eval_docs is None else pack(eval_docs, seq_len, tokenizer.pad_id))


def check_trainable(config: DataConfig, tokenizer, split: SplitRows, seq_len: int,
                    global_batch_size: int) -> None:
    """A DataError when the train split has nothing to train on or less than one global batch."""
    train_docs, train_rows = split.train_docs, split.train_rows
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
    if config.preference:
        raise ValueError("make_datasets: a config of preference pairs goes to make_preference_datasets")
    if config.labelled:
        raise ValueError("make_datasets: a config with label_column goes to make_labelled_datasets")
    tokenizer = load_tokenizer(config.tokenizer) if tokenizer is None else tokenizer
    split = split_rows(config, tokenizer, seq_len, seed)
    check_trainable(config, tokenizer, split, seq_len, global_batch_size)
    common = dict(mesh=mesh, rules=rules, process_index=process_index, process_count=process_count)
    train = BatchIterator(
        split.train_rows,
        global_batch_size,
        seed=seed,
        shuffle=True,
        repeat=True,
        **common,
    )
    evaluation = None
    if split.eval_rows is not None:
        evaluation = BatchIterator(
            split.eval_rows,
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


def _pair_readers(config: DataConfig, tokenizer, seq_len: int, batch_size: int):
    """``(pairs(spec), pack(pairs))``: a source's tokenized preference pairs, and their rows
    (unpaired rows with their mismatched KL pairs within runs of ``batch_size`` rows)."""
    if config.examples or config.chat or config.labelled:
        raise DataError("preference pairs are read from 'prompt'/'chosen'/'rejected' columns: drop "
                        "--prompt-column/--completion-column/--chat-column/--label-column")
    for name in ("max_prompt_length", "max_completion_length"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise DataError(f"--{name.replace('_', '-')} must be at least 1, got {value}")

    def pairs(spec):
        ds = load_source(spec, cache_dir=config.cache_dir)
        tokenize = tokenize_unpaired if config.unpaired else tokenize_pairs
        return tokenize(ds, tokenizer, spec, add_bos=config.add_bos, skip_bad=config.skip_missing)

    def pack(p):
        if config.unpaired:
            p = kl_pairs(p, batch_size)
        return pack_pairs(p, seq_len, tokenizer.pad_id, config.max_prompt_length, config.max_completion_length)

    return pairs, pack


def make_preference_eval_dataset(config: DataConfig, tokenizer, seq_len: int, global_batch_size: int, *,
                                 split: str = "all", seed: int = 0, mesh=None, rules=None) -> BatchIterator:
    """One in-order pass over the preference pairs of ``config.data`` (``split="all"``), or of
    the pairs ``make_preference_datasets`` trains on (``"train"``) or holds out (``"eval"``)
    under ``config.eval_fraction`` and ``seed``; the last batch filled up with pairs of weight 0."""
    if split not in ("all", "train", "eval"):
        raise DataError(f"--split {split!r}: expected all, train or eval")
    if split != "all" and not 0.0 < config.eval_fraction < 1.0:
        raise DataError(f"--split {split} needs the --eval-fraction in (0, 1) the run held out")
    pairs, pack = _pair_readers(config, tokenizer, seq_len, global_batch_size)
    rows = pairs(config.data)
    if split != "all":
        if len(rows) < 2:
            raise DataError(f"data {config.data!r} has {len(rows)} pair: nothing to split")
        rows = rows.select(split_indices(len(rows), config.eval_fraction, seed)[split == "eval"])
    return BatchIterator(pack(rows), global_batch_size, seed=seed, shuffle=False, repeat=False, mesh=mesh,
                         rules=rules)


def make_preference_datasets(
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
    """(train iterator, eval iterator or None) over preference pairs (``preference.py``): one
    pair per row, ``[2, seq_len]`` tokens (chosen, rejected); resumable like every iterator."""
    _check_eval_split(config)
    tokenizer = load_tokenizer(config.tokenizer) if tokenizer is None else tokenizer
    pairs, pack = _pair_readers(config, tokenizer, seq_len, global_batch_size)
    train_pairs, eval_pairs = pairs(config.data), None
    if config.eval_data:
        eval_pairs = pairs(config.eval_data)
    elif config.eval_fraction:
        if len(train_pairs) < 2:
            raise DataError(f"data {config.data!r} has {len(train_pairs)} pair: --eval-fraction needs at least 2")
        kept, held_out = split_indices(len(train_pairs), config.eval_fraction, seed)
        train_pairs, eval_pairs = train_pairs.select(kept), train_pairs.select(held_out)
    if len(train_pairs) < global_batch_size:
        raise DataError(f"data {config.data!r}: {len(train_pairs)} preference pairs, fewer than one global "
                        f"batch of {global_batch_size}")
    common = dict(mesh=mesh, rules=rules, process_index=process_index, process_count=process_count)
    train = BatchIterator(pack(train_pairs), global_batch_size, seed=seed, shuffle=True, repeat=True, **common)
    evaluation = None
    if eval_pairs is not None:
        evaluation = BatchIterator(pack(eval_pairs), global_batch_size, seed=seed, shuffle=False, repeat=False,
                                   **common)
    return train, evaluation
