"""Multiple-choice accuracy by log-likelihood (``shardzoo eval --task multiple-choice``).

Multiple choice follows lm-evaluation-harness's ``multiple_choice`` tasks. Each row ``{context,
choices, label}`` becomes one request ``(context, delimiter + choice)`` per choice, the delimiter
being ``--target-delimiter`` (default ``" "``, the harness's ``target_delimiter``). Spaces the data
writes at the seam (at the end of the context, at the start of a choice) are taken off first, so
``"A: " + "x"``, ``"A:" + " x"`` and ``"A:" + "x"`` are the same request ``("A:", " x")``. A request
is encoded as the harness's ``_encode_pair`` does: trailing whitespace of the context moves to the
continuation, ``context + continuation`` is tokenized whole and the continuation's tokens are those
past the context's own. A choice scores the sum of its tokens' log-probabilities given everything
before them. ``acc`` picks the highest sum; ``acc_norm`` the highest sum divided by the choice's
length in characters without the delimiter (the harness's ``len(choice)``). Sequences go through
the model in batches, sharded as the Program lays out params and batch.
"""

from __future__ import annotations

import jax
import numpy as np

from shardzoo.errors import UserError
from shardzoo.sharding.mesh import describe_mesh
from shardzoo.train.eval_common import eval_progress, text_program
from shardzoo.train.program import Program

MC_COLUMNS = ("context", "choices", "label")
TARGET_DELIMITER = " "  # lm-evaluation-harness's default target_delimiter


def read_choices(spec: str, target_delimiter: str = TARGET_DELIMITER) -> list[dict]:
    """The rows ``{context, choices, label, continuations}`` of a data spec (e.g. a JSONL file),
    checked, as lm-evaluation-harness's requests: the spaces at the seam of context and choice
    taken off (``context`` without trailing spaces, ``choices`` without leading ones) and each
    continuation ``target_delimiter + choice``."""
    from shardzoo.data import DataError, load_source

    ds = load_source(spec)
    missing = [c for c in MC_COLUMNS if c not in ds.column_names]
    if missing:
        raise DataError(f"data {spec!r} has no column {missing[0]!r} (multiple choice needs "
                        f"{', '.join(MC_COLUMNS)}); its columns are: {', '.join(ds.column_names)}")
    rows = []
    for n, row in enumerate(ds.select_columns(list(MC_COLUMNS)), 1):
        context, choices, label = (row[c] for c in MC_COLUMNS)
        where = f"data {spec!r}, row {n}"
        if not isinstance(context, str):
            raise DataError(f"{where}: context is {type(context).__name__}, not text")
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c.lstrip(" ")
                                                              for c in choices)):
            raise DataError(f"{where}: choices must be a non-empty list of texts other than spaces")
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
            raise DataError(f"{where}: label {label!r} is not an index of its {len(choices)} choices")
        choices = [c.lstrip(" ") for c in choices]
        rows.append({"context": context.rstrip(" "), "choices": choices, "label": label,
                     "continuations": [target_delimiter + c for c in choices]})
    return rows


def encode_pair(tokenizer, context: str, continuation: str, add_bos: bool) -> tuple[list[int], list[int]]:
    """``(context ids, continuation ids)`` as lm-evaluation-harness's ``_encode_pair``: trailing
    whitespace of the context moves to the continuation, the whole text is tokenized at once and
    the continuation is the tokens past the context's own; an empty context starts with bos."""
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    prefix = [tokenizer.bos_id] if add_bos or not stripped else []
    head = prefix + list(tokenizer.encode(stripped))
    whole = prefix + list(tokenizer.encode(stripped + continuation))
    return head, whole[len(head):]


def _sequences(rows, tokenizer, add_bos: bool):
    """``(row, choice, ids, first target index)`` of every choice of every row."""
    out = []
    for i, row in enumerate(rows):
        for j, continuation in enumerate(row["continuations"]):
            head, tail = encode_pair(tokenizer, row["context"], continuation, add_bos)
            if not tail:
                raise UserError(f"row {i + 1}: choice {j} encodes to no tokens after the context")
            out.append((i, j, head + tail, len(head)))
    return out


def mc_batch(items, seq_len: int, batch_size: int, pad_id: int) -> dict:
    """The lm batch of up to ``batch_size`` sequences: ids truncated on the left to ``seq_len + 1``
    tokens, the choice's tokens the only targets; missing rows are all padding (weight 0)."""
    shape = (batch_size, seq_len)
    batch = {k: np.zeros(shape, np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
    batch["inputs"][:] = batch["targets"][:] = pad_id
    batch["weights"] = np.zeros(shape, np.float32)
    for r, (_, _, ids, start) in enumerate(items):
        cut = max(0, len(ids) - (seq_len + 1))
        ids, start = ids[cut:], start - cut
        n = len(ids) - 1
        batch["inputs"][r, :n], batch["targets"][r, :n] = ids[:-1], ids[1:]
        batch["positions"][r, :n] = np.arange(n)
        batch["segment_ids"][r, :n] = 1
        batch["weights"][r, start - 1:n] = 1.0  # targets ids[start:] are the choice's tokens
    return batch


def score_choices(program: Program, params, rows, tokenizer, add_bos: bool = False) -> dict:
    """Multiple-choice accuracy of ``rows`` (``read_choices``) and every choice's summed
    log-likelihood; batches of ``program.batch_size`` sequences of ``program.seq_len``."""
    seqs = _sequences(rows, tokenizer, add_bos)
    for i, j, ids, start in seqs:
        if len(ids) - start > program.seq_len:
            raise UserError(f"row {i + 1}: choice {j} is {len(ids) - start} tokens, more than "
                            f"--seq-len {program.seq_len}")
    score = program.compiled_score_step()
    b = program.batch_size
    logprobs = [np.zeros(len(r["choices"])) for r in rows]
    greedy = [np.zeros(len(r["choices"]), bool) for r in rows]
    with eval_progress(-(-len(seqs) // b), "scoring") as bar:
        for k in range(0, len(seqs), b):
            items = seqs[k:k + b]
            # every process builds the whole batch alike; place() hands each device its rows
            batch = mc_batch(items, program.seq_len, b, tokenizer.pad_id)
            out = jax.device_get(score(params, program.place(batch)))
            for r, (i, j, _, _) in enumerate(items):
                logprobs[i][j], greedy[i][j] = out["logprob"][r], out["greedy"][r]
            bar.update()
    lengths = [np.asarray([len(c) for c in r["choices"]], np.float64) for r in rows]  # no delimiter
    acc = [int(np.argmax(lp)) == r["label"] for lp, r in zip(logprobs, rows, strict=True)]
    acc_norm = [int(np.argmax(lp / n)) == r["label"] for lp, n, r in zip(logprobs, lengths, rows, strict=True)]
    return {"task": "multiple-choice", "acc": float(np.mean(acc)), "acc_norm": float(np.mean(acc_norm)),
            "acc_norm_by": "characters", "rows": len(rows), "sequences": len(seqs),
            "logprobs": [lp.tolist() for lp in logprobs],
            "greedy": [g.tolist() for g in greedy]}


def mc_seq_len(rows, tokenizer, add_bos: bool, max_len: int) -> int:
    """The default sequence length of multiple choice: the longest sequence (inputs are one
    token shorter than the ids), rounded up to a multiple of 8, at most ``max_len``."""
    longest = max(len(ids) - 1 for _, _, ids, _ in _sequences(rows, tokenizer, add_bos))
    return min(-(-longest // 8) * 8, max_len)


def check_choices(s) -> None:
    """``--task multiple-choice`` reads ``--data``'s rows before the model loads (fails fast)."""
    if s.data is None:
        raise UserError("--task multiple-choice needs --data FILE of rows {context, choices, label}")
    read_choices(s.data, _delimiter(s))


def _delimiter(s) -> str:
    return TARGET_DELIMITER if s.target_delimiter is None else s.target_delimiter


def evaluate_choices_run(s, run: dict, recorded: dict, config, params, mesh, rules, tokenizer) -> dict:
    """``--task multiple-choice``: accuracy over ``--data``'s rows by each choice's log-likelihood."""
    rows = read_choices(s.data, _delimiter(s))
    program, params, add_bos = text_program(s, recorded, config, params, mesh, rules, tokenizer,
                                            lambda add_bos, max_len: mc_seq_len(rows, tokenizer, add_bos, max_len))
    metrics = {**score_choices(program, params, rows, tokenizer, add_bos), "target_delimiter": _delimiter(s)}
    metrics.update(data=s.data, model=s.checkpoint or s.hf, batch_size=program.batch_size, seq_len=program.seq_len,
                   add_bos=bool(add_bos), rules=rules.name, mesh=describe_mesh(mesh))
    return metrics


def format_choices(metrics: dict) -> str:
    return (f"multiple-choice over {metrics['rows']} rows: acc {metrics['acc']:.4f}, "
            f"acc_norm {metrics['acc_norm']:.4f} (log-likelihood / characters)")
