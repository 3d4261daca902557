"""Preference pairs (DPO and its variants) in TRL's standard formats, tokenized as TRL does.

A row is one pair: ``prompt`` / ``chosen`` / ``rejected`` as text, or as conversations (lists of
``{role, content}`` messages rendered with the tokenizer's chat template), or the implicit-prompt
form: ``chosen`` / ``rejected`` conversations (or texts) whose shared first turns (characters)
are the prompt (TRL's ``extract_prompt``). The tokens that score are those of the completion:

- text: ``prompt`` and ``prompt + chosen`` are tokenized (``[bos]`` first with ``add_bos``), eos
  ends each completion;
- conversational: ``prompt`` is rendered with the generation prompt, ``prompt + chosen`` without,
  each tokenized as one text;

and the completion starts where the two token lists first differ (TRL's
``common_prefix_length``, taken over both completions). Each pair becomes a row of two sequences
(chosen, rejected) of ``seq_len`` tokens. Truncation: the prompt keeps its last
``max_prompt_length`` tokens, each completion its first ``max_completion_length``, and the whole
sequence its first ``seq_len``; pairs cut by any of these are counted (``truncated``).

Bad rows (a null value, an empty completion, chosen identical to rejected, a completion cut away
entirely) are a ``DataError`` naming the data, the row (1-based) and the column, or, with
``skip_bad``, skipped and counted in one warning line.

Unpaired (KTO) rows (``tokenize_unpaired``): TRL's ``prompt`` / ``completion`` / bool ``label``,
each tokenized as a pair's chosen side; ``kl_pairs`` gives each its mismatched second sequence
(TRL's KL completion), and the batches carry ``labels``.

Batches (``PreferenceRows.batch``), each ``[batch, 2, seq_len]`` with the chosen sequence first:
``inputs``, ``targets``, ``positions``, ``segment_ids`` (int32) and ``loss_mask`` (float32: 1
where the target is a completion token); per pair ``weights`` (1, 0 for the rows that fill up an
epoch's last batch) and ``truncated`` (1 for a truncated pair) and ``margin`` (the optional
``margin`` column, TRL's reward-model margin; 0 without), float32 ``[batch]``; and with
reference log-probabilities stored (``with_reference``), ``ref_logps`` float32 ``[batch, 2]``.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from shardzoo.data.chat import check_messages, renderer_for
from shardzoo.data.errors import DataError
from shardzoo.sharding import axes as ax

PROMPT, CHOSEN, REJECTED = "prompt", "chosen", "rejected"
MARGIN = "margin"  # reward models: TRL's optional per-pair margin column
COMPLETION, LABEL = "completion", "label"
SEQ_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


def common_prefix_length(a, b) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def extract_prompt(chosen, rejected):
    """(prompt, chosen, rejected) of an implicit-prompt pair: the longest shared prefix (of
    messages, or of characters with a space before the split kept off the prompt) as TRL's
    ``extract_prompt`` takes it."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):  # noqa: B007 - TRL's loop, kept as is
        if chosen[idx] != rejected[idx]:
            if isinstance(chosen, str) and chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _is_chat(value) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and isinstance(value[0], dict)


@dataclasses.dataclass(frozen=True)
class Pairs:
    """Tokenized pairs: per pair the prompt's, the chosen and the rejected completion's ids."""

    prompts: list
    chosen: list
    rejected: list
    rows: np.ndarray  # each pair's row in the data (0-based)
    spec: str = ""  # the data they came from
    labels: np.ndarray | None = None  # unpaired (KTO) rows: each completion's label (desirable: True)
    margins: np.ndarray | None = None  # the data's optional ``margin`` column (reward models), float32

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, indices) -> Pairs:
        idx = [int(i) for i in indices]
        return Pairs([self.prompts[i] for i in idx], [self.chosen[i] for i in idx],
                     [self.rejected[i] for i in idx], self.rows[idx], self.spec,
                     None if self.labels is None else self.labels[idx],
                     None if self.margins is None else self.margins[idx])


class _Tokenizer:
    """Renders and tokenizes one pair as TRL's DPOTrainer does (see the module docstring)."""

    def __init__(self, tokenizer, spec: str, add_bos: bool, conversational: bool):
        self.tokenizer, self.spec, self.add_bos = tokenizer, spec, add_bos
        self.renderer = renderer_for(tokenizer, CHOSEN) if conversational else None

    def _ids(self, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text))
        if self.add_bos and not (ids and ids[0] == self.tokenizer.bos_id):
            ids = [self.tokenizer.bos_id] + ids
        return ids

    def pair(self, prompt, chosen, rejected, row: int):
        if self.renderer is None:
            eos = [self.tokenizer.eos_id]
            p, pc, pr = self._ids(prompt), self._ids(prompt + chosen) + eos, self._ids(prompt + rejected) + eos
        else:
            import jinja2

            where = f"row {row + 1} of data {self.spec!r}"
            prompt = check_messages(prompt, row + 1, PROMPT)
            try:
                p = self._ids(self.renderer.render(prompt, add_generation_prompt=True))
                pc = self._ids(self.renderer.render(prompt + check_messages(chosen, row + 1, CHOSEN)))
                pr = self._ids(self.renderer.render(prompt + check_messages(rejected, row + 1, REJECTED)))
            except jinja2.TemplateError as e:
                raise DataError(f"chat template {self.renderer.where} fails on {where}: {e}".splitlines()[0]) \
                    from None
        n = min(common_prefix_length(p, pc), common_prefix_length(p, pr))
        return p[:n], pc[n:], pr[n:]


def tokenize_pairs(ds, tokenizer, spec: str, *, add_bos: bool = False, skip_bad: bool = False) -> Pairs:
    """Every row of ``ds`` as a tokenized pair (see the module docstring)."""
    columns = ds.column_names
    implicit = PROMPT not in columns
    for column in ((CHOSEN, REJECTED) if implicit else (PROMPT, CHOSEN, REJECTED)):
        if column not in columns:
            raise DataError(f"data {spec!r} has no column {column!r}: preference data needs "
                            f"'prompt', 'chosen' and 'rejected' columns (or 'chosen' and 'rejected' "
                            f"conversations that share their first turns); its columns are: "
                            f"{', '.join(columns)}")
    first = ds[0]
    conversational = _is_chat(first[CHOSEN])
    tok = _Tokenizer(tokenizer, spec, add_bos, conversational)
    prompts, chosen, rejected, rows, bad = [], [], [], [], []
    wanted = (CHOSEN, REJECTED) if implicit else (PROMPT, CHOSEN, REJECTED)
    for row, example in enumerate(ds.select_columns(list(wanted))):
        try:
            pair = _one_pair(tok, example, implicit, conversational, spec, row)
        except DataError as e:
            if not skip_bad:
                raise DataError(f"{e} (or pass --skip-missing to skip such rows)") from None
            bad.append(str(e))
            continue
        prompts.append(np.asarray(pair[0], np.int32))
        chosen.append(np.asarray(pair[1], np.int32))
        rejected.append(np.asarray(pair[2], np.int32))
        rows.append(row)
    if bad:
        sys.stderr.write(f"shardzoo: warning: data {spec!r}: skipped {len(bad)} of {len(ds)} bad preference "
                         f"pairs (--skip-missing); the first: {bad[0]}\n")
    if not prompts:
        raise DataError(f"data {spec!r}: no usable preference pair in its {len(ds)} rows")
    margins = _margins(ds, spec, rows) if MARGIN in columns else None
    return Pairs(prompts, chosen, rejected, np.asarray(rows, np.int64), spec, margins=margins)


def _margins(ds, spec: str, rows: list) -> np.ndarray:
    """The kept rows' ``margin`` values (TRL's reward-model column): a finite number each."""
    values = ds[MARGIN]
    out = np.zeros(len(rows), np.float32)
    for i, row in enumerate(rows):
        value = values[row]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise DataError(f"data {spec!r}: row {row + 1}, column {MARGIN!r}: {value!r} is not a finite number")
        out[i] = value
    return out


def _one_pair(tok, example, implicit: bool, conversational: bool, spec: str, row: int, unpaired: bool = False):
    """One pair's token ids, or (``unpaired``: KTO's ``completion`` in both sides) one example's."""
    where = f"data {spec!r}: row {row + 1}"
    named = (lambda c: COMPLETION if c in (CHOSEN, REJECTED) else c) if unpaired else (lambda c: c)
    for column, value in example.items():
        if value is None:
            raise DataError(f"{where} has no value in column {named(column)!r} (null)")
        if conversational and isinstance(value, (list, tuple)) and not value:
            continue  # an empty completion is refused below; an empty prompt is allowed
        if _is_chat(value) != conversational:
            kind = "conversations" if conversational else "text"
            raise DataError(f"{where}, column {named(column)!r}: holds a {type(value).__name__}, but the data's "
                            f"{named(CHOSEN)!r} column holds {kind}")
    if implicit:
        prompt, chosen, rejected = extract_prompt(example[CHOSEN], example[REJECTED])
    else:
        prompt, chosen, rejected = example[PROMPT], example[CHOSEN], example[REJECTED]
    for column, value in ((CHOSEN, chosen), (REJECTED, rejected)):
        if len(value) == 0 or (isinstance(value, str) and not value.strip()):
            raise DataError(f"{where}, column {named(column)!r}: empty completion"
                            + (" (after the prompt both completions share)" if implicit else ""))
    if chosen == rejected and not unpaired:
        raise DataError(f"{where}, column 'chosen': identical to column 'rejected'")
    p, c, r = tok.pair(prompt, chosen, rejected, row)
    for column, ids in ((CHOSEN, c), (REJECTED, r)):
        if len(ids) == 0:
            raise DataError(f"{where}, column {named(column)!r}: no completion token after tokenizing")
    return p, c, r


def tokenize_unpaired(ds, tokenizer, spec: str, *, add_bos: bool = False, skip_bad: bool = False) -> Pairs:
    """Every row of ``ds`` as an unpaired (KTO) example: TRL's ``prompt`` / ``completion`` (text or
    conversations, tokenized as a pair's chosen side) and ``label`` (a bool: desirable). The
    ``rejected`` side holds the completion again until ``kl_pairs`` sets the mismatched one."""
    columns = ds.column_names
    for column in (PROMPT, COMPLETION, LABEL):
        if column not in columns:
            raise DataError(f"data {spec!r} has no column {column!r}: unpaired (KTO) data needs 'prompt', "
                            f"'completion' and 'label' columns; its columns are: {', '.join(columns)}")
    conversational = _is_chat(ds[0][COMPLETION])
    tok = _Tokenizer(tokenizer, spec, add_bos, conversational)
    prompts, completions, labels, rows, bad = [], [], [], [], []
    for row, example in enumerate(ds.select_columns([PROMPT, COMPLETION, LABEL])):
        try:
            label = example[LABEL]
            if not isinstance(label, (bool, np.bool_)):
                raise DataError(f"data {spec!r}: row {row + 1}, column 'label': holds {label!r}, not a bool "
                                "(true: a desirable completion, false: an undesirable one)")
            p, c, _ = _one_pair(tok, {PROMPT: example[PROMPT], CHOSEN: example[COMPLETION],
                                      REJECTED: example[COMPLETION]}, False, conversational, spec, row, unpaired=True)
        except DataError as e:
            if not skip_bad:
                raise DataError(f"{e} (or pass --skip-missing to skip such rows)") from None
            bad.append(str(e))
            continue
        prompts.append(np.asarray(p, np.int32))
        completions.append(np.asarray(c, np.int32))
        labels.append(bool(label))
        rows.append(row)
    if bad:
        sys.stderr.write(f"shardzoo: warning: data {spec!r}: skipped {len(bad)} of {len(ds)} bad rows "
                         f"(--skip-missing); the first: {bad[0]}\n")
    if not prompts:
        raise DataError(f"data {spec!r}: no usable row in its {len(ds)} rows")
    return Pairs(prompts, completions, list(completions), np.asarray(rows, np.int64), spec, np.asarray(labels, bool))


def kl_pairs(pairs: Pairs, batch_size: int) -> Pairs:
    """KTO's mismatched pairs as TRL's KTOTrainer builds them: within each run of ``batch_size``
    rows, row ``i``'s second sequence is its prompt with row ``i - 1``'s completion (cyclically)."""
    kl = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs.chosen[start:start + batch_size]
        kl.extend(chunk[-1:] + chunk[:-1])
    return dataclasses.replace(pairs, rejected=kl)


@dataclasses.dataclass
class PreferenceRows:
    """Pairs laid out as ``[2, seq_len]`` rows for ``BatchIterator`` (see the module docstring)."""

    tokens: np.ndarray  # [pairs, 2, length] int32
    lengths: np.ndarray  # [pairs, 2] int64: real tokens of each sequence
    prompt_lengths: np.ndarray  # [pairs] int64: the prompt's tokens (kept) at the start
    truncated: np.ndarray  # [pairs] bool
    pad_id: int
    ref_logps: np.ndarray | None = None  # [pairs, 2] float32 once the reference is stored
    labels: np.ndarray | None = None  # [pairs] bool: unpaired (KTO) rows' labels
    margins: np.ndarray | None = None  # [pairs] float32: the ``margin`` column (None: zeros)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[2]

    @property
    def shapes(self) -> dict:
        shapes = dict.fromkeys(SEQ_KEYS, (2, self.seq_len))
        shapes.update(weights=(), truncated=(), margin=())
        if self.labels is not None:
            shapes["labels"] = ()
        if self.ref_logps is not None:
            shapes["ref_logps"] = (2,)
        return shapes

    @property
    def axes(self) -> dict:
        axes = dict.fromkeys(SEQ_KEYS, (ax.BATCH, None, ax.LENGTH))
        axes.update(weights=(ax.BATCH,), truncated=(ax.BATCH,), margin=(ax.BATCH,))
        if self.labels is not None:
            axes["labels"] = (ax.BATCH,)
        if self.ref_logps is not None:
            axes["ref_logps"] = (ax.BATCH, None)
        return axes

    def with_reference(self, ref_logps) -> PreferenceRows:
        return dataclasses.replace(self, ref_logps=np.asarray(ref_logps, np.float32))

    def batch(self, indices: np.ndarray) -> dict:
        """The batch of the pairs at ``indices`` (-1: a fill-up row of weight 0)."""
        real = indices >= 0
        picked = np.maximum(indices, 0)
        length = self.seq_len
        cols = np.arange(length)
        lengths = np.where(real[:, None], self.lengths[picked], 0)  # [batch, 2]
        valid = cols < lengths[..., None]  # [batch, 2, length]
        inputs = np.where(valid, self.tokens[picked], self.pad_id)
        targets = np.full_like(inputs, self.pad_id)
        targets[..., :-1] = np.where(valid[..., 1:], inputs[..., 1:], self.pad_id)
        # a target scores when it is a completion token: from the prompt's end to the sequence's
        start = self.prompt_lengths[picked][:, None, None]
        loss_mask = valid[..., 1:] & (cols[1:] >= start)
        out = {
            "inputs": inputs.astype(np.int32),
            "targets": targets.astype(np.int32),
            "positions": np.where(valid, cols, 0).astype(np.int32),
            "segment_ids": valid.astype(np.int32),
            "loss_mask": np.concatenate([loss_mask, np.zeros_like(loss_mask[..., :1])], -1).astype(np.float32),
            "weights": real.astype(np.float32),
            "truncated": (real & self.truncated[picked]).astype(np.float32),
            "margin": (np.zeros(len(indices)) if self.margins is None
                       else np.where(real, self.margins[picked], 0.0)).astype(np.float32),
        }
        if self.labels is not None:
            out["labels"] = (real & self.labels[picked]).astype(np.float32)
        if self.ref_logps is not None:
            out["ref_logps"] = np.where(real[:, None], self.ref_logps[picked], 0).astype(np.float32)
        return out


def pack_pairs(pairs: Pairs, seq_len: int, pad_id: int, max_prompt_length: int | None = None,
               max_completion_length: int | None = None) -> PreferenceRows:
    """Each pair as two sequences ``prompt + completion`` of ``seq_len`` tokens, truncated as the
    module docstring says."""
    n = len(pairs)
    tokens = np.full((n, 2, seq_len), pad_id, np.int32)
    lengths = np.zeros((n, 2), np.int64)
    prompt_lengths = np.zeros(n, np.int64)
    truncated = np.zeros(n, bool)
    for i in range(n):
        prompt = pairs.prompts[i]
        if max_prompt_length is not None and len(prompt) > max_prompt_length:
            prompt, truncated[i] = prompt[len(prompt) - max_prompt_length:], True
        prompt_lengths[i] = min(len(prompt), seq_len)
        for j, completion in enumerate((pairs.chosen[i], pairs.rejected[i])):
            if max_completion_length is not None and len(completion) > max_completion_length:
                completion, truncated[i] = completion[:max_completion_length], True
            sequence = np.concatenate([prompt, completion])
            if len(sequence) > seq_len:
                sequence, truncated[i] = sequence[:seq_len], True
            tokens[i, j, : len(sequence)] = sequence
            lengths[i, j] = len(sequence)
        if lengths[i].min() <= prompt_lengths[i]:
            row = int(pairs.rows[i]) + 1
            raise DataError(f"data {pairs.spec!r}: row {row}: its prompt of {len(prompt)} tokens leaves no completion token "
                            f"within --seq-len {seq_len}; raise --seq-len or set --max-prompt-length")
    return PreferenceRows(tokens, lengths, prompt_lengths, truncated, pad_id, labels=pairs.labels,
                          margins=pairs.margins)
