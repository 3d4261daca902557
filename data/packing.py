"""Tokenized documents, packed into rows of ``seq_len``, and the batch arrays of those rows.

Three layouts:

- **packed** (language modelling): every document is ``[bos?] tokens eos``; the documents are
  concatenated and cut into rows of ``seq_len`` (the last row padded). ``segment_ids`` number the
  documents within a row from 1 (0 = padding), ``positions`` restart at 0 where a document (or
  its continuation from the previous row) starts, so attention never crosses documents.
- **examples** (fine-tuning): one ``[bos?] prompt completion eos`` per row, truncated to
  ``seq_len`` and padded; only completion tokens (and the closing eos) are loss targets.
- **conversations** (chat fine-tuning, ``chat.py``): each conversation truncated to ``seq_len``
  and whole conversations packed in order into rows (a new row when the next one does not
  fit), numbered by ``segment_ids``; only assistant tokens are loss targets.

Targets are the next token within the same segment of the same row; the weight is 0 on a
segment's last position in the row, on padding and (examples) where the target is a prompt token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pyarrow.compute as pc

from shardzoo.sharding import axes as ax


@dataclasses.dataclass(frozen=True)
class Documents:
    """Token ids of many documents back to back, and which tokens are loss targets."""

    tokens: np.ndarray  # [total] int32
    offsets: np.ndarray  # [documents + 1] int64; document i is tokens[offsets[i]:offsets[i + 1]]
    loss_mask: np.ndarray  # [total] bool: True where the token may be a target

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def select(self, indices) -> Documents:
        """The documents at ``indices``, kept in corpus order."""
        keep = np.zeros(len(self), bool)
        keep[np.asarray(indices, np.int64)] = True
        token_keep = np.repeat(keep, self.lengths)
        offsets = np.concatenate([[0], np.cumsum(self.lengths[keep])])
        return Documents(self.tokens[token_keep], offsets, self.loss_mask[token_keep])


BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


@dataclasses.dataclass(frozen=True)
class Rows:
    """Packed rows: token ids, segment ids (0 = padding) and loss-target flags.

    Rows for ``BatchIterator``: ``len``, ``axes`` (each batch key's logical axes) and
    ``batch(indices)``.
    """

    tokens: np.ndarray  # [rows, length] int32
    segment_ids: np.ndarray  # [rows, length] int32
    loss_mask: np.ndarray  # [rows, length] bool
    pad_id: int

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of one row of each batch key."""
        return dict.fromkeys(BATCH_KEYS, (self.seq_len,))

    @property
    def axes(self) -> dict[str, tuple[str, ...]]:
        """Each batch key's logical axes."""
        return dict.fromkeys(BATCH_KEYS, (ax.BATCH, ax.LENGTH))

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The batch of the rows at ``indices`` (-1: an all-padding row)."""
        return batch_arrays(self, indices, self.pad_id)


def _encode(tokenizer, texts) -> list:
    texts = [t or "" for t in texts]  # None (a missing value) reads as an empty text
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(t) for t in texts]


def _map(ds, encode, tokenizer, *what, with_indices: bool = False):
    """``ds.map(encode)`` batched, fingerprinted by the input's fingerprint, ``tokenizer``'s and
    ``what`` (the function's name and every argument that changes its output): datasets would
    otherwise hash the function with dill, and a closure it cannot pickle (datasets 5.0.1 on the
    TPU machine) costs a warning and a random fingerprint, so a file-backed dataset's cache
    was written anew on every run."""
    mine = getattr(tokenizer, "fingerprint", None)  # None: a tokenizer of the user's, left to datasets
    key = json.dumps([getattr(ds, "_fingerprint", None), mine, encode.__qualname__, *what], default=str)
    # num_proc=None, not 1: datasets 5.2 runs num_proc=1 in a forked worker pool, and a fork
    # after JAX has started its threads can deadlock.
    return ds.map(encode, batched=True, with_indices=with_indices, remove_columns=ds.column_names,
                  desc="tokenizing",
                  new_fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16] if mine else None)


def _documents_from(ds) -> Documents:
    """Read the ``input_ids``/``loss_mask`` list columns of a mapped dataset into flat numpy arrays."""
    table = ds.with_format("arrow")[:]
    ids = table.column("input_ids")
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    tokens = pc.list_flatten(ids).to_numpy(zero_copy_only=False).astype(np.int32)
    mask = pc.list_flatten(table.column("loss_mask")).to_numpy(zero_copy_only=False).astype(bool)
    nonempty = lengths > 0
    offsets = np.concatenate([[0], np.cumsum(lengths[nonempty])])
    return Documents(tokens, offsets, mask)


def tokenize_documents(ds, tokenizer, text_column: str, add_bos: bool = False) -> Documents:
    """Tokenize one text column with a batched ``datasets`` map; each document ends with eos."""
    prefix = np.asarray([tokenizer.bos_id] if add_bos else [], np.int32)
    eos = np.asarray([tokenizer.eos_id], np.int32)

    def encode(batch):
        docs = [
            np.concatenate([prefix, np.asarray(ids, np.int32), eos]) if len(ids) else eos[:0]
            for ids in _encode(tokenizer, batch[text_column])
        ]
        return {"input_ids": docs, "loss_mask": [np.ones(len(d), bool) for d in docs]}

    return _documents_from(_map(ds, encode, tokenizer, text_column, add_bos))


def tokenize_examples(
    ds, tokenizer, prompt_column: str, completion_column: str, add_bos: bool = False
) -> Documents:
    """Tokenize prompt/completion pairs into ``[bos?] prompt completion eos`` with the completion
    (and the eos that ends it) as the only loss targets."""
    prefix = np.asarray([tokenizer.bos_id] if add_bos else [], np.int32)
    eos = np.asarray([tokenizer.eos_id], np.int32)

    def encode(batch):
        prompts = _encode(tokenizer, batch[prompt_column])
        completions = _encode(tokenizer, batch[completion_column])
        docs, masks = [], []
        for p, c in zip(prompts, completions, strict=True):
            head = len(prefix) + len(p)
            docs.append(
                np.concatenate([prefix, np.asarray(p, np.int32), np.asarray(c, np.int32), eos])
            )
            masks.append(np.arange(len(docs[-1])) >= head)
        return {"input_ids": docs, "loss_mask": masks}

    return _documents_from(_map(ds, encode, tokenizer, prompt_column, completion_column, add_bos))


def split_indices(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out), each sorted: a seeded random ``fraction`` of ``range(n)`` held out (at
    least one, and at least one kept). Documents and labelled examples are split alike."""
    n_eval = min(max(1, round(fraction * n)), n - 1)
    held_out = np.random.default_rng([seed, 1]).permutation(n)[:n_eval]
    return np.setdiff1d(np.arange(n), held_out), np.sort(held_out)


def split_documents(docs: Documents, fraction: float, seed: int) -> tuple[Documents, Documents]:
    """(train, eval): a seeded random ``fraction`` of the documents held out (``split_indices``)."""
    rest, held_out = split_indices(len(docs), fraction, seed)
    return docs.select(rest), docs.select(held_out)


def pack_documents(docs: Documents, seq_len: int, pad_id: int) -> Rows:
    """Concatenate the documents and cut the stream into rows of ``seq_len`` (last row padded)."""
    total = len(docs.tokens)
    num_rows = -(-total // seq_len)
    tokens = np.full(num_rows * seq_len, pad_id, np.int32)
    tokens[:total] = docs.tokens
    doc_ids = np.zeros(num_rows * seq_len, np.int32)  # 1-based document number, 0 = padding
    doc_ids[:total] = np.repeat(np.arange(1, len(docs) + 1, dtype=np.int32), docs.lengths)
    mask = np.zeros(num_rows * seq_len, bool)
    mask[:total] = docs.loss_mask
    doc_ids = doc_ids.reshape(num_rows, seq_len)  # [rows, length]
    # Renumber per row from 1: documents in a row are consecutive and a row never starts with padding.
    segment_ids = np.where(doc_ids > 0, doc_ids - doc_ids[:, :1] + 1, 0).astype(np.int32)
    return Rows(
        tokens.reshape(num_rows, seq_len), segment_ids, mask.reshape(num_rows, seq_len), pad_id
    )


def pack_examples(docs: Documents, seq_len: int, pad_id: int) -> Rows:
    """One document per row, truncated to ``seq_len`` and padded."""
    cols = np.arange(seq_len)
    valid = cols < np.minimum(docs.lengths, seq_len)[:, None]  # [rows, length]
    source = np.where(valid, docs.offsets[:-1, None] + cols, 0)
    tokens = np.where(valid, docs.tokens[source], pad_id).astype(np.int32)
    return Rows(tokens, valid.astype(np.int32), valid & docs.loss_mask[source], pad_id)


def pack_conversations(docs: Documents, seq_len: int, pad_id: int) -> Rows:
    """Each document truncated to ``seq_len``, whole documents packed in order into rows: the
    next one starts a new row when it does not fit the rest of the current one."""
    lengths = np.minimum(docs.lengths, seq_len)
    row_of = np.empty(len(docs), np.int64)
    col_of = np.empty(len(docs), np.int64)
    row, used = 0, 0
    for i, n in enumerate(lengths.tolist()):
        if used + n > seq_len:
            row, used = row + 1, 0
        row_of[i], col_of[i] = row, used
        used += n
    num_rows = row + 1 if len(docs) else 0
    doc = np.repeat(np.arange(len(docs)), lengths)  # [kept tokens]: its document
    within = np.arange(len(doc)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    source = docs.offsets[doc] + within
    first_doc = np.searchsorted(row_of, np.arange(num_rows))  # each row's first document
    where = (row_of[doc], col_of[doc] + within)
    tokens = np.full((num_rows, seq_len), pad_id, np.int32)
    segment_ids = np.zeros((num_rows, seq_len), np.int32)
    mask = np.zeros((num_rows, seq_len), bool)
    tokens[where] = docs.tokens[source]
    segment_ids[where] = doc - first_doc[row_of[doc]] + 1
    mask[where] = docs.loss_mask[source]
    return Rows(tokens, segment_ids, mask, pad_id)


def batch_arrays(rows: Rows, indices: np.ndarray, pad_id: int) -> dict[str, np.ndarray]:
    """The batch dict of the rows at ``indices`` (-1 = an all-padding row)."""
    real = (indices >= 0)[:, None]
    picked = np.maximum(indices, 0)
    segment_ids = np.where(real, rows.segment_ids[picked], 0)  # [batch, length]
    inputs = np.where(segment_ids > 0, rows.tokens[picked], pad_id)
    loss_mask = real & rows.loss_mask[picked]
    # A target exists where the next position is in the same (non-padding) segment.
    same = np.zeros_like(loss_mask)
    same[:, :-1] = (segment_ids[:, :-1] == segment_ids[:, 1:]) & (segment_ids[:, :-1] > 0)
    targets = np.full_like(inputs, pad_id)
    targets[:, :-1] = np.where(same[:, :-1], inputs[:, 1:], pad_id)
    weights = np.zeros(inputs.shape, np.float32)
    weights[:, :-1] = same[:, :-1] & loss_mask[:, 1:]
    # Positions count from each segment's first position in the row.
    cols = np.arange(inputs.shape[1])
    starts = np.ones(inputs.shape, bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    positions = cols - np.maximum.accumulate(np.where(starts, cols, 0), axis=1)
    positions = np.where(segment_ids > 0, positions, 0).astype(np.int32)
    return {
        "inputs": inputs.astype(np.int32),
        "targets": targets.astype(np.int32),
        "segment_ids": segment_ids.astype(np.int32),
        "positions": positions,
        "weights": weights,
    }
