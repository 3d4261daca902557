"""``shardzoo eval``: a language model's loss, perplexity and token accuracy over a whole split,
and multiple-choice accuracy by log-likelihood, under any rule table.

Language modelling: one in-order pass over every row of the split (``data.make_eval_dataset``,
the pipeline the trainer's eval uses; the last batch filled up with rows of weight 0) through
the Program's compiled eval step. Its per-batch sums (weighted loss, weight, correct guesses)
are added up in float64 on the host and divided once at the end, so the numbers are those of
one batch holding the whole split.

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

import dataclasses
import json
import math
import os
import sys

import jax
import numpy as np

from shardzoo.data import DataConfig
from shardzoo.errors import UserError
from shardzoo.sharding.mesh import describe_mesh
from shardzoo.train import model_info
from shardzoo.train.defaults import (
    DEFAULT_SEQ_LEN,
    STDLIB_EVAL_FRACTION,
    adds_bos,
    default_seq_len,
    mesh_and_rules,
)
from shardzoo.train.metrics import progress
from shardzoo.train.program import Program
from shardzoo.train.step import merge_sums
from shardzoo.train.tasks import summarize_eval

TASKS = ("lm", "multiple-choice", "dpo", "kto", "rewards", "reward")
MC_COLUMNS = ("context", "choices", "label")
TARGET_DELIMITER = " "  # lm-evaluation-harness's default target_delimiter
DATA_FIELDS = {f.name for f in dataclasses.fields(DataConfig)}


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What ``shardzoo eval`` was asked (its flags; see ``cli.add_eval_args``)."""

    data: str | None = None  # None: the data the run (--checkpoint) trained on
    checkpoint: str | None = None
    hf: str | None = None
    task: str | None = None  # None: the run's (dpo for a preference run), else lm
    reference: str | None = None  # --task dpo: the reference model (default: the run's)
    # --task rewards (a grpo run's default): completions sampled for prompts, scored by reward functions
    reward_funcs: tuple[str, ...] | None = None  # None: the run's
    reward_weights: tuple[float, ...] | None = None
    num_generations: int | None = None  # completions per prompt: the grpo run's, else 1
    max_completion_length: int | None = None  # None: the run's, else half --seq-len
    temperature: float | None = None  # None: the run's, else 1.0; 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    target_delimiter: str | None = None  # None: TARGET_DELIMITER (multiple choice only)
    split: str = "all"
    eval_fraction: float | None = None  # None (and seed, columns, add_bos, seq_len): the run's
    seed: int | None = None
    text_column: str | None = None
    prompt_column: str | None = None
    completion_column: str | None = None
    chat_column: str | None = None
    add_bos: bool = False
    rules: str | None = None
    mesh: str | None = None
    dtype: str | None = None
    step: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    out: str | None = None


def _progress(total: int | None, desc: str):
    """``metrics.progress``: a bar on stderr when it is a terminal, from process 0 only."""
    return progress(total, desc, jax.process_index() == 0)


# --------------------------------------------------------------------------- language modelling
def evaluate_lm(program: Program, params, batches, total: int | None = None) -> dict:
    """Loss, perplexity and token accuracy over every batch of ``batches`` (the data contract's
    dicts; rows of weight 0 count nothing), by ``program``'s compiled eval step."""
    step = program.compiled_eval_step()
    totals, count = {}, 0
    with _progress(total if total is not None else getattr(batches, "batches_per_epoch", None), "eval") as bar:
        for batch in batches:
            sums = jax.device_get(step(params, program.place(batch)))
            for key, value in sums.items():
                totals[key] = totals.get(key, 0.0) + float(value)  # float64 on the host
            count += 1
            bar.update()
    if not count or totals["weight"] <= 0:
        raise UserError("the evaluation data has no target tokens")
    summary = summarize_eval(program.task, totals)
    return {"task": "lm", "loss": summary["eval_loss"],
            "perplexity": float(math.exp(min(summary["eval_loss"], 700.0))),
            "token_accuracy": summary["eval_accuracy"], "tokens": int(round(totals["weight"])),
            "batches": count}


# --------------------------------------------------------------------------- labelled examples
def run_classes(recorded_meta: dict) -> list[str] | None:
    """The class names a classification run recorded (None: integer labels, or an older run)."""
    return ((recorded_meta or {}).get("classes") or {}).get("names")


def labelled_rows(config: DataConfig, split: str, seed: int, names: list[str] | None):
    """The labelled examples of ``split`` of ``config``'s data, their class ids those of the run
    (``names``, the classes it recorded): a class the run did not train on is a DataError."""
    from shardzoo.data import DataError, make_labelled_datasets

    if split == "all":
        config = dataclasses.replace(config, eval_fraction=0.0, eval_data=None)
    train, held_out = make_labelled_datasets(config, jax.process_count(), seed=seed)
    rows = held_out.rows if split == "eval" else train.rows
    found = rows.label_names
    if rows.num_classes is None or (found is None and names is None):
        return rows
    if found is None or names is None:
        raise DataError(f"data {config.data!r}: label column {config.label_column!r} holds "
                        f"{'class names' if found else 'class ids'} but the run was trained on "
                        f"{'class names' if names else 'class ids'}")
    unknown = [n for n in found if n not in names]
    if unknown:
        raise DataError(f"data {config.data!r}: class {unknown[0]!r} of label column {config.label_column!r} "
                        f"is not one the run was trained on ({', '.join(names)})")
    ids = np.asarray([names.index(n) for n in found], np.int32)
    return dataclasses.replace(rows, targets=ids[rows.targets], num_classes=len(names), label_names=tuple(names))


def evaluate_labelled(program: Program, params, batches, names) -> dict:
    """Loss (and accuracy, over all and per class) of a classification or regression model over
    every batch, by ``program``'s compiled eval step (the trainer's) and its predictions."""
    import jax.numpy as jnp

    from shardzoo.sharding.partition import activate
    from shardzoo.train.tasks import forward

    step = program.compiled_eval_step()
    classify = program.task.name == "classification"
    predict = jax.jit(lambda p, b: jnp.argmax(forward(program.task, program.module, p, b, jax.random.PRNGKey(0),
                                                      True)[0], axis=-1))
    totals, count = {}, 0
    seen = correct = None
    with _progress(getattr(batches, "batches_per_epoch", None), "eval") as bar:
        for batch in batches:
            placed = program.place(batch)
            for key, value in jax.device_get(step(params, placed)).items():
                totals[key] = totals.get(key, 0.0) + float(value)
            if classify:
                with activate(program.mesh):
                    guess = np.asarray(predict(params, placed))
                target = np.asarray(batch["targets"])
                real = np.asarray(batch["weights"]) > 0
                n = len(names) if names else program.config.num_outputs
                seen = (0 if seen is None else seen) + np.bincount(target[real], minlength=n)
                correct = (0 if correct is None else correct) + np.bincount(
                    target[real & (guess == target)], minlength=n)
            count += 1
            bar.update()
    if not count or totals["weight"] <= 0:
        raise UserError("the evaluation data has no examples")
    summary = summarize_eval(program.task, totals)
    out = {"task": program.task.name, "loss": summary["eval_loss"], "examples": int(round(totals["weight"])),
           "batches": count}
    if classify:
        labels = names or [str(i) for i in range(len(seen))]
        out["accuracy"] = summary["eval_accuracy"]
        out["classes"] = list(labels)
        out["per_class"] = {name: {"examples": int(seen[i]),
                                   "accuracy": float(correct[i] / seen[i]) if seen[i] else None}
                            for i, name in enumerate(labels)}
    return out


def evaluate_labelled_run(s: EvalSettings, recorded: dict, config, params, mesh, rules, tokenizer) -> dict:
    """``shardzoo eval`` of a classification or regression run on its recorded data (or --data)."""
    from shardzoo.data.batches import LabelledBatchIterator
    from shardzoo.train.sources import READS_RUNS, open_source

    if s.checkpoint is None or "label_column" not in recorded:
        raise UserError(f"eval of a {model_info.task(config)} model needs --checkpoint of the run "
                        "that trained it (its run.json names the label column)")
    names = run_classes(open_source(s.checkpoint, step=s.step, what="--checkpoint", accept=READS_RUNS).meta)
    data_config, split = _data_config(s, recorded, tokenizer, False)
    seed = s.seed if s.seed is not None else recorded.get("seed", 0)
    rows = labelled_rows(data_config, split, seed, names)
    if rows.num_classes is not None and rows.num_classes > config.num_outputs:
        raise UserError(f"data {data_config.data!r}: class id {rows.num_classes - 1} of label column "
                        f"{data_config.label_column!r}, the model has num_outputs={config.num_outputs}")
    batch_size = s.batch_size or mesh.size * max(1, 8 // mesh.size)
    program = Program(config, rules, mesh, batch_size=batch_size)
    params = jax.device_put(params, program.shardings.params)
    batches = LabelledBatchIterator(rows, batch_size, seed=seed, shuffle=False, repeat=False, mesh=mesh,
                                    rules=rules)
    metrics = {**evaluate_labelled(program, params, batches, names), "split": split}
    if split != "all":
        metrics.update(eval_fraction=data_config.eval_fraction, seed=seed)
    metrics.update(data=data_config.data, model=s.checkpoint, batch_size=batch_size, rules=rules.name,
                   mesh=describe_mesh(mesh))
    return metrics


# --------------------------------------------------------------------------- preference pairs
def evaluate_preference(program: Program, params, reference, batches) -> dict:
    """A preference task's loss and TRL's ``rewards/*`` and ``logps/*`` over every pair of
    ``batches``, against ``reference`` (a frozen copy's params; None: ``params`` themselves, whose
    LoRA adapters the reference step switches off), summed in float64 on the host."""
    step, totals, count = program.compiled_eval_step(), {}, 0
    ref_step = program.compiled_reference_step() if program.task.reference_keys else None
    with _progress(getattr(batches, "batches_per_epoch", None), "eval") as bar:
        for batch in batches:
            placed = program.place(batch)
            if ref_step is not None:
                placed = {**placed, **ref_step(params if reference is None else reference, placed)}
            out = {k: float(v) for k, v in jax.device_get(step(params, placed)).items()}
            totals = merge_sums(totals, out) if totals else out  # the reward task's min/max: by min/max
            count += 1
            bar.update()
    if not count or totals["weight"] <= 0:
        raise UserError("the evaluation data has no preference pairs")
    summary = summarize_eval(program.task, totals)
    rows = "examples" if program.task.name == "kto" else "pairs"
    return {"task": program.task.name, "loss": summary.pop("eval_loss"), rows: int(round(totals["weight"])),
            "batches": count, **{k.removeprefix("eval_"): v for k, v in summary.items()}}


def _reference_params(program: Program, task_settings: dict, model_settings: dict, seed: int, s: EvalSettings):
    """The reference a DPO run trained against, placed as ``program``'s params: ``--reference``
    (eval's, else the run's), else its ``--init-from``, else the seed's initial params; None
    where the reference step runs the policy itself (``program.reference`` "adapters") or the
    loss has no reference."""
    from shardzoo.train.hub import is_hub_id
    from shardzoo.train.preference import load_reference

    if program.reference in (None, "adapters"):
        return None
    target = program.abstract.params
    path = s.reference or task_settings.get("reference") or model_settings.get("init_from")
    given = None
    if path is not None:
        if not os.path.exists(path) and not is_hub_id(path):
            raise UserError(f"the run's reference model {path} is not there (relative to {os.getcwd()}): "
                            "name it with --reference DIR")
        given = load_reference(path, target, program.config)
    keys = np.asarray(jax.random.split(jax.random.PRNGKey(seed)), np.uint32)  # the trainer's init key
    return program.init(keys[1], params=given).params


WHAT = {"dpo": "preference pairs", "kto": "unpaired (KTO) rows", "reward": "preference pairs"}


def evaluate_preference_run(s: EvalSettings, run: dict, config, params, mesh, rules, tokenizer) -> dict:
    """``shardzoo eval`` of a preference (``--task dpo``) run, or of a model with ``--task dpo``:
    its loss and reward metrics on preference pairs (the run's held-out pairs with ``--split
    eval``), against the reference it trained with; ``--task reward``: a reward model's loss and
    TRL's accuracy, margin and min/mean/max rewards on the pairs (no reference)."""
    from shardzoo.data import make_preference_eval_dataset
    from shardzoo.train.preference import DPO_SETTINGS, kto_task, preference_task

    settings = run.get("settings") or {}
    task_settings, data_settings = settings.get("task") or {}, settings.get("data") or {}
    model_settings = settings.get("model") or {}
    if s.task == "reward":
        from shardzoo.train.reward import reward_task

        if not getattr(getattr(config, "arch", None), "score_head", False):
            raise UserError("--task reward scores with a reward model: this model has no score head")
        task = reward_task(task_settings.get("center_rewards_coefficient"))
    else:
        if task_settings.get("task") != s.task and s.reference is None:
            raise UserError(f"--task {s.task} of a model that did not train on {WHAT[s.task]} needs --reference DIR")
        if s.task == "kto":
            names, make = ("loss", "beta", "desirable_weight", "undesirable_weight"), kto_task
        else:
            names, make = ("loss", "beta", "label_smoothing", "simpo_gamma", "cpo_alpha", *DPO_SETTINGS), preference_task
        task = make(**{n: task_settings[n] for n in names if task_settings.get(n) is not None})
    recorded = {k: v for k, v in data_settings.items() if v is not None}
    data, split = s.data or recorded.get("data"), s.split
    if data is None:
        raise UserError("--data SPEC of preference pairs is required (only a run that records its data defaults to it)")
    if split == "eval" and s.data is None and s.eval_fraction is None and recorded.get("eval_data"):
        data, split = recorded["eval_data"], "all"
    same = data == recorded.get("data")
    fraction = s.eval_fraction if s.eval_fraction is not None else recorded.get("eval_fraction", 0.0) if same else 0.0
    seed = s.seed if s.seed is not None else (settings.get("optimizer") or {}).get("seed", 0)
    add_bos = s.add_bos or recorded.get("add_bos", False)
    data_config = DataConfig(data=data, eval_fraction=fraction or 0.0, tokenizer=tokenizer.spec, add_bos=add_bos,
                             preference=True, unpaired=s.task == "kto", skip_missing=recorded.get("skip_missing", False),
                             max_prompt_length=recorded.get("max_prompt_length"),
                             max_completion_length=recorded.get("max_completion_length"))
    seq_len = s.seq_len or default_seq_len(config, recorded.get("seq_len"))
    batch_size = s.batch_size or mesh.size * max(1, 8 // mesh.size)
    reference = None
    if getattr(task, "uses_reference", False):
        reference = "adapters" if model_info.lora_rank(config) and not (s.reference or task_settings.get("reference")) \
            else "copy"
    program = Program(config, rules, mesh, task=task, batch_size=batch_size, seq_len=seq_len, reference=reference)
    params = jax.device_put(params, program.shardings.params)
    ref_params = _reference_params(program, task_settings, model_settings, seed, s)
    batches = make_preference_eval_dataset(data_config, tokenizer, seq_len, batch_size, split=split, seed=seed,
                                           mesh=mesh, rules=rules)
    metrics = {**evaluate_preference(program, params, ref_params, batches), "split": split}
    if s.task != "reward":
        metrics.update(loss_type=task.loss, beta=task.beta, reference={
            "copy": "frozen copy", "adapters": "the base (adapters off)"}.get(reference, "none"))
    if split != "all":
        metrics.update(eval_fraction=fraction, seed=seed)
    metrics.update(data=data, model=s.checkpoint or s.hf, batch_size=batch_size, seq_len=seq_len,
                   rules=rules.name, mesh=describe_mesh(mesh))
    return metrics


# --------------------------------------------------------------------------- multiple choice
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
    with _progress(-(-len(seqs) // b), "scoring") as bar:
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


# --------------------------------------------------------------------------- the command
def run_settings(checkpoint: str) -> dict:
    """The data settings (``data``, columns, ``eval_fraction``, ``add_bos``, ``seq_len``) and
    ``seed`` a run recorded in its run.json; empty when it has none (e.g. an import-hf dir)."""
    from shardzoo.train.sources import READS_RUNS, open_source

    return open_source(checkpoint, what="--checkpoint", accept=READS_RUNS).run_settings()


def _run_json(checkpoint: str) -> dict:
    """The whole run.json of a --checkpoint run ({} for a source without one)."""
    from shardzoo.train.rundir import RunDirError, read_run_json
    from shardzoo.train.sources import READS_RUNS, open_source

    source = open_source(checkpoint, what="--checkpoint", accept=READS_RUNS)
    try:
        run = read_run_json(source.run_dir)
    except RunDirError:
        return {}  # run_settings (next) names a damaged run.json
    return run if isinstance(run, dict) else {}


def _data_config(s: EvalSettings, run: dict, tokenizer, add_bos: bool):
    """``(data config, split)`` of an lm eval: the flags, else what the run recorded (its eval
    fraction only for the run's own data); ``--split eval`` of a run that held out
    ``--eval-data`` is all of that data."""
    data, split = s.data or run.get("data"), s.split
    if split == "eval" and s.data is None and s.eval_fraction is None and run.get("eval_data"):
        data, split = run["eval_data"], "all"
    same = data == run.get("data")
    fraction = s.eval_fraction if s.eval_fraction is not None else run.get("eval_fraction") if same else None
    if fraction is None:  # what `shardzoo train` holds out of the embedded corpus by default
        fraction = STDLIB_EVAL_FRACTION if data == "stdlib" and not (same and run.get("eval_data")) else 0.0
    flags = {"text_column": s.text_column, "prompt_column": s.prompt_column,
             "completion_column": s.completion_column, "chat_column": s.chat_column}
    if any(v is not None for v in flags.values()):
        layout = {k: v for k, v in flags.items() if v is not None}
    else:  # the run's columns and row layout (data of the same layout), else the text column
        own = {"data", "eval_data", "eval_fraction", "tokenizer", "add_bos", "cache_dir"}
        layout = {k: v for k, v in run.items() if k in DATA_FIELDS - own}
    config = DataConfig(data=data, eval_fraction=fraction, tokenizer=tokenizer.spec, add_bos=add_bos,
                        **layout)
    return config, split


def run(s: EvalSettings) -> dict:
    """Load the model (``--checkpoint`` or ``--hf``), evaluate it as ``s`` says, write the
    metrics to ``s.out`` as JSON when given, and return them."""
    import datasets

    from shardzoo.data import make_eval_dataset
    from shardzoo.train import hf_io

    if not sys.stderr.isatty():  # keep a user error one line on a log
        datasets.disable_progress_bars()
    if (s.checkpoint is None) == (s.hf is None):
        raise UserError("give one of --checkpoint DIR or --hf DIR")
    whole_run = _run_json(s.checkpoint) if s.checkpoint else {}
    run_task = ((whole_run.get("settings") or {}).get("task") or {}).get("task")
    if s.task is None:  # the run's own task
        s = dataclasses.replace(s, task={"dpo": "dpo", "kto": "kto", "grpo": "rewards", "rloo": "rewards",
                                         "reward": "reward"}.get(run_task, "lm"))
    if s.task not in TASKS:
        raise UserError(f"--task {s.task!r}: expected one of {', '.join(TASKS)}")
    if s.reference is not None and s.task not in ("dpo", "kto"):
        raise UserError("--reference goes with --task dpo or kto")
    given = [f for f in REWARD_FLAGS if getattr(s, f) != EvalSettings.__dataclass_fields__[f].default]
    if given and s.task != "rewards":
        raise UserError(f"--{given[0].replace('_', '-')} goes with --task rewards")
    if s.step is not None and s.checkpoint is None:
        raise UserError("--step picks a checkpoint of a run: it goes with --checkpoint, not --hf")
    if (s.batch_size is not None and s.batch_size < 1) or (s.seq_len is not None and s.seq_len < 1):
        raise UserError("--batch-size and --seq-len must be positive")
    if s.out and os.path.isdir(s.out):
        raise UserError(f"--out {s.out} is a directory: name the JSON file to write")
    recorded = run_settings(s.checkpoint) if s.checkpoint else {}
    if s.task == "multiple-choice" and s.data is None:
        raise UserError("--task multiple-choice needs --data FILE of rows {context, choices, label}")
    if s.data is None and "data" not in recorded:
        raise UserError("--data SPEC is required (only a run that records its data defaults to it)")
    if s.target_delimiter is not None and s.task != "multiple-choice":
        raise UserError("--target-delimiter goes with --task multiple-choice")
    delimiter = TARGET_DELIMITER if s.target_delimiter is None else s.target_delimiter
    rows = read_choices(s.data, delimiter) if s.task == "multiple-choice" else None  # fail fast
    mesh, rules = mesh_and_rules(s.mesh, s.rules)
    module, config, params, tokenizer = hf_io.load_for_generate(s.checkpoint, s.hf, mesh, rules, s.dtype,
                                                                step=s.step)
    if s.task == "rewards":
        if model_info.task(config) != "lm":
            raise UserError(f"--task rewards samples from a language model; this model does {model_info.task(config)}")
        return _finish(s, evaluate_rewards_run(s, whole_run, config, params, mesh, rules, tokenizer))
    if s.task in ("dpo", "kto", "reward"):
        if model_info.task(config) != "lm":
            raise UserError(f"--task {s.task} scores a language model; this model does {model_info.task(config)}")
        return _finish(s, evaluate_preference_run(s, whole_run, config, params, mesh, rules, tokenizer))
    if model_info.task(config) != "lm":
        return _finish(s, evaluate_labelled_run(s, recorded, config, params, mesh, rules, tokenizer))
    add_bos = s.add_bos or recorded.get("add_bos", adds_bos(tokenizer))
    max_len = model_info.max_positions(config) or DEFAULT_SEQ_LEN
    if s.seq_len is not None and s.seq_len > max_len:
        raise UserError(f"--seq-len {s.seq_len} exceeds the model's max_position_embeddings {max_len}")
    batch_size = s.batch_size or mesh.size * max(1, 8 // mesh.size)
    if rows is not None:
        seq_len = s.seq_len or mc_seq_len(rows, tokenizer, add_bos, max_len)
    else:
        seq_len = s.seq_len or default_seq_len(config, recorded.get("seq_len"))
    program = Program(config, rules, mesh, batch_size=batch_size, seq_len=seq_len)
    params = jax.device_put(params, program.shardings.params)
    if rows is not None:
        metrics = {**score_choices(program, params, rows, tokenizer, add_bos), "target_delimiter": delimiter}
        data = s.data
    else:
        config, split = _data_config(s, recorded, tokenizer, add_bos)
        seed = s.seed if s.seed is not None else recorded.get("seed", 0)
        batches = make_eval_dataset(config, tokenizer, seq_len, batch_size, split=split, seed=seed,
                                    mesh=mesh, rules=rules)
        metrics = {**evaluate_lm(program, params, batches), "split": split}
        if split != "all":
            metrics.update(eval_fraction=config.eval_fraction, seed=seed)
        data = config.data
    metrics.update(data=data, model=s.checkpoint or s.hf, batch_size=batch_size, seq_len=seq_len,
                   add_bos=bool(add_bos), rules=rules.name, mesh=describe_mesh(mesh))
    return _finish(s, metrics)


REWARD_FLAGS = ("reward_funcs", "reward_weights", "num_generations", "max_completion_length", "temperature",
                "top_k", "top_p")


def evaluate_rewards_run(s: EvalSettings, run: dict, config, params, mesh, rules, tokenizer) -> dict:
    """``shardzoo eval --task rewards`` (a grpo run's default): ``--num-generations`` completions
    per prompt of ``--data`` (default: the run's prompts; ``--split eval`` the ones it held out),
    sampled by the Program's decoding as the run's rollouts were (its temperature, top-k, top-p and
    completion length unless given; ``--temperature 0``: greedy), scored by the reward functions
    (default: the run's, with its weights); TRL's reward metrics over them
    (``train.rollouts.reward_metrics``). The same seed samples the same completions: with a grpo
    run's defaults (its seed, ``--num-generations``, ``--batch-size``) the ones its own
    evaluations sampled, so ``--split eval`` gives the run's final ``eval_*``."""
    from shardzoo.data import load_source
    from shardzoo.data.prompts import split_prompts, tokenize_prompts
    from shardzoo.train.grpo import load_reward_function
    from shardzoo.train.rollouts import held_out_key, reward_metrics, sample_and_score, sampler_key

    settings = run.get("settings") or {}
    task, data_settings = settings.get("task") or {}, settings.get("data") or {}
    specs = s.reward_funcs or task.get("reward_funcs")
    reward_model = None if s.reward_funcs else task.get("reward_model")  # the run's, after its functions
    if not specs and not reward_model:
        raise UserError("--task rewards needs --reward-funcs FILE.py:FUNCTION[,...] (this model records none)")
    functions = [load_reward_function(spec) for spec in specs or ()]
    weights = s.reward_weights if s.reward_weights is not None else \
        (task.get("reward_weights") if not s.reward_funcs else None) or (1.0,) * (len(functions) + bool(reward_model))
    if len(weights) != len(functions) + bool(reward_model):
        raise UserError(f"--reward-weights has {len(weights)} values for {len(functions)} reward functions")
    data, split = s.data or data_settings.get("data"), s.split
    if data is None:
        raise UserError("--data SPEC of prompts is required (only a run that records its data defaults to it)")
    if split == "eval" and s.data is None and s.eval_fraction is None and data_settings.get("eval_data"):
        data, split = data_settings["eval_data"], "all"
    same = data == data_settings.get("data")
    fraction = s.eval_fraction if s.eval_fraction is not None else data_settings.get("eval_fraction") if same else None
    if split != "all" and not fraction:
        raise UserError(f"--split {split}: no prompts of {data} were held out (give --eval-fraction, or the "
                        "held-out prompts as --data)")
    temperature = s.temperature if s.temperature is not None else task.get("temperature", 1.0)
    group = s.num_generations if s.num_generations is not None else \
        (task.get("num_generations") if task.get("task") in ("grpo", "rloo") else None) or 1
    if temperature == 0 and s.num_generations is None:
        group = 1  # greedy: one completion per prompt
    if group < 1:
        raise UserError(f"--num-generations must be at least 1, got {group}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise UserError(f"--temperature must be a finite number >= 0, got {temperature}")
    if temperature == 0 and group > 1:
        raise UserError(f"--num-generations {group} at --temperature 0: greedy decoding gives one completion")
    sampling = {"temperature": float(temperature), "top_k": s.top_k if s.top_k is not None else task.get("top_k", 0),
                "top_p": s.top_p if s.top_p is not None else task.get("top_p", 1.0)}
    seq_len = s.seq_len or data_settings.get("seq_len") or default_seq_len(config, None)
    completion = s.max_completion_length or (data_settings.get("max_completion_length") if not s.seq_len else None) \
        or seq_len // 2
    width = seq_len - completion
    if width < 1:
        raise UserError(f"--max-completion-length {completion} leaves no room for a prompt in --seq-len {seq_len}")
    add_bos = s.add_bos or data_settings.get("add_bos", False)
    prompts = tokenize_prompts(load_source(data), tokenizer, data, add_bos=add_bos,
                               max_prompt_length=min(data_settings.get("max_prompt_length") or width, width),
                               skip_bad=data_settings.get("skip_missing", False))
    seed = s.seed if s.seed is not None else (settings.get("optimizer") or {}).get("seed", 0)
    if split != "all":
        train, held_out = split_prompts(prompts, fraction, seed)
        prompts = held_out if split == "eval" else train
    rows = s.batch_size or (data_settings.get("batch_size") if task.get("task") in ("grpo", "rloo") else None) \
        or mesh.size * max(1, 8 // mesh.size)
    per_call = max(1, rows // group)  # a grpo run's: its rollouts' shape (its evaluations' calls and keys)
    if reward_model:  # the run's --reward-model, sharded by these rules
        from shardzoo.train.reward import reward_model_program
        from shardzoo.train.rollouts import reward_model_function

        scored = -(-per_call * group // mesh.size) * mesh.size  # its rows: a multiple of the devices
        scorer = reward_model_program(reward_model, rules, mesh, batch_size=scored, seq_len=seq_len)
        functions.append(reward_model_function(reward_model, scorer, tokenizer))
    program = Program(config, rules, mesh)
    params = jax.device_put(params, program.shardings.params)
    parts = []
    with _progress(-(-len(prompts) // per_call), "rewards") as bar:
        for start in range(0, len(prompts), per_call):
            key = held_out_key(sampler_key(seed), start // per_call)
            parts.append(sample_and_score(program, params, prompts, range(start, min(start + per_call, len(prompts))),
                                          per_call, key=key, tokenizer=tokenizer, functions=functions, group=group,
                                          width=width, completion=completion, sampling=sampling))
            bar.update()
    metrics = {"task": "rewards", "prompts": len(prompts), "completions": len(prompts) * group,
               "num_generations": group,
               **reward_metrics(np.concatenate([p.rewards for p in parts]), weights, functions,
                                np.concatenate([p.lengths for p in parts]), np.concatenate([p.ended for p in parts])),
               "reward_funcs": list(specs or ()), **({"reward_model": reward_model} if reward_model else {}),
               "reward_weights": [float(w) for w in weights], **sampling,
               "max_completion_length": completion, "seq_len": seq_len, "seed": seed, "split": split, "data": data,
               "model": s.checkpoint or s.hf, "batch_size": per_call * group, "rules": rules.name,
               "mesh": describe_mesh(mesh)}
    if split != "all":
        metrics["eval_fraction"] = fraction
    return metrics


def _finish(s: EvalSettings, metrics: dict) -> dict:
    """Write ``metrics`` to ``--out`` (process 0) and return them."""
    if s.out and jax.process_index() == 0:
        try:
            with open(s.out, "w") as f:
                json.dump(metrics, f, indent=1)
                f.write("\n")
        except OSError as e:
            raise UserError(f"--out {s.out}: cannot write: {e.strerror}") from None
    return metrics


def format_metrics(metrics: dict) -> str:
    """One line of the headline numbers."""
    if metrics["task"] == "classification":
        per_class = ", ".join(f"{name} {c['accuracy']:.4f} of {c['examples']}"
                              for name, c in metrics["per_class"].items() if c["examples"])
        return (f"classification over {metrics['examples']} examples: accuracy {metrics['accuracy']:.4f}, "
                f"loss {metrics['loss']:.4f}; per class: {per_class}")
    if metrics["task"] == "regression":
        return f"regression over {metrics['examples']} examples: mse {metrics['loss']:.6g}"
    if metrics["task"] == "kto":
        return (f"kto ({metrics['loss_type']}, beta {metrics['beta']:g}, reference: {metrics['reference']}) over "
                f"{metrics['examples']} examples: loss {metrics['loss']:.4f}, kl {metrics['kl']:.4f}, rewards/margins "
                f"{metrics['rewards/margins']:.4f}, logps/chosen {metrics['logps/chosen']:.4f}, logps/rejected "
                f"{metrics['logps/rejected']:.4f}")
    if metrics["task"] == "reward":
        return (f"reward over {metrics['pairs']} pairs: loss {metrics['loss']:.4f}, accuracy {metrics['accuracy']:.4f}, "
                f"margin {metrics['margin']:.4f}, rewards min/mean/max {metrics['min_reward']:.4f} / "
                f"{metrics['mean_reward']:.4f} / {metrics['max_reward']:.4f}")
    if metrics["task"] == "dpo":
        return (f"dpo ({metrics['loss_type']}, beta {metrics['beta']:g}, reference: {metrics['reference']}) over "
                f"{metrics['pairs']} pairs: loss {metrics['loss']:.4f}, rewards/accuracies "
                f"{metrics['rewards/accuracies']:.4f}, rewards/margins {metrics['rewards/margins']:.4f}, "
                f"logps/chosen {metrics['logps/chosen']:.4f}, logps/rejected {metrics['logps/rejected']:.4f}")
    if metrics["task"] == "rewards":
        per = ", ".join(f"{k[len('rewards/'):-len('/mean')]} {v:.4f}" for k, v in metrics.items()
                        if k.startswith("rewards/") and k.endswith("/mean"))
        how = "greedy" if metrics["temperature"] == 0 else f"temperature {metrics['temperature']:g}"
        return (f"rewards over {metrics['completions']} completions ({metrics['num_generations']} per prompt of "
                f"{metrics['prompts']}, {how}): reward {metrics['reward']:.4f} (std {metrics['reward_std']:.4f}); "
                f"{per}; mean length {metrics['completions/mean_length']:.1f}, clipped "
                f"{metrics['completions/clipped_ratio']:.2f}")
    if metrics["task"] == "multiple-choice":
        return (f"multiple-choice over {metrics['rows']} rows: acc {metrics['acc']:.4f}, "
                f"acc_norm {metrics['acc_norm']:.4f} (log-likelihood / characters)")
    return (f"eval over {metrics['tokens']} tokens in {metrics['batches']} batches: loss "
            f"{metrics['loss']:.4f}, perplexity {metrics['perplexity']:.4f}, token accuracy "
            f"{metrics['token_accuracy']:.4f}")
