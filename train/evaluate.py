"""``shardzoo eval``: a language model's loss, perplexity and token accuracy over a whole split,
and multiple-choice accuracy by log-likelihood, under any rule table.

Language modelling: one in-order pass over every row of the split (``data.make_eval_dataset``,
the pipeline the trainer's eval uses; the last batch filled up with rows of weight 0) through
the Program's compiled eval step. Its per-batch sums (weighted loss, weight, correct guesses)
are added up in float64 on the host and divided once at the end, so the numbers are those of
one batch holding the whole split.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable

import jax

from shardzoo.errors import UserError
from shardzoo.sharding.mesh import describe_mesh
from shardzoo.train import model_info
from shardzoo.train.defaults import default_seq_len, mesh_and_rules
from shardzoo.train.eval_choices import check_choices, evaluate_choices_run, format_choices
from shardzoo.train.eval_common import (
    data_config_of_eval,
    eval_progress,
    run_json,
    run_settings,
    text_program,
)
from shardzoo.train.eval_labelled import evaluate_labelled_run, format_labelled
from shardzoo.train.program import Program
from shardzoo.train.tasks.base import summarize_eval
from shardzoo.train.tasks.preference_eval import evaluate_preference_run, format_preference
from shardzoo.train.tasks.registry import RUN_TASKS
from shardzoo.train.tasks.rollouts_eval import REWARD_FLAGS, evaluate_rewards_run, format_rewards


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



# --------------------------------------------------------------------------- language modelling
def evaluate_lm(program: Program, params, batches, total: int | None = None) -> dict:
    """Loss, perplexity and token accuracy over every batch of ``batches`` (the data contract's
    dicts; rows of weight 0 count nothing), by ``program``'s compiled eval step."""
    step = program.compiled_eval_step()
    totals, count = {}, 0
    with eval_progress(total if total is not None else getattr(batches, "batches_per_epoch", None), "eval") as bar:
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


def run(s: EvalSettings) -> dict:
    """Load the model (``--checkpoint`` or ``--hf``), evaluate it as ``s`` says, write the
    metrics to ``s.out`` as JSON when given, and return them."""
    import datasets

    from shardzoo.train.io import hf_io

    if not sys.stderr.isatty():  # keep a user error one line on a log
        datasets.disable_progress_bars()
    if (s.checkpoint is None) == (s.hf is None):
        raise UserError("give one of --checkpoint DIR or --hf DIR")
    whole_run = run_json(s.checkpoint) if s.checkpoint else {}
    if s.task is None:  # the run's own task's evaluation
        trained = ((whole_run.get("settings") or {}).get("task") or {}).get("task")
        s = dataclasses.replace(s, task=RUN_TASKS[trained].eval_task if trained in RUN_TASKS else "lm")
    if s.task not in EVAL_TASKS:
        raise UserError(f"--task {s.task!r}: expected one of {', '.join(EVAL_TASKS)}")
    spec = EVAL_TASKS[s.task]
    for flag in (f for other in EVAL_TASKS.values() for f in other.flags if f not in spec.flags):
        if getattr(s, flag) != EvalSettings.__dataclass_fields__[flag].default:
            takers = [name for name, other in EVAL_TASKS.items() if flag in other.flags]
            raise UserError(f"--{flag.replace('_', '-')} goes with --task {' or '.join(takers)}")
    if s.step is not None and s.checkpoint is None:
        raise UserError("--step picks a checkpoint of a run: it goes with --checkpoint, not --hf")
    if (s.batch_size is not None and s.batch_size < 1) or (s.seq_len is not None and s.seq_len < 1):
        raise UserError("--batch-size and --seq-len must be positive")
    if s.out and os.path.isdir(s.out):
        raise UserError(f"--out {s.out} is a directory: name the JSON file to write")
    recorded = run_settings(s.checkpoint) if s.checkpoint else {}
    if spec.check is not None:
        spec.check(s)
    if s.data is None and "data" not in recorded:
        raise UserError("--data SPEC is required (only a run that records its data defaults to it)")
    mesh, rules = mesh_and_rules(s.mesh, s.rules)
    module, config, params, tokenizer = hf_io.load_for_generate(s.checkpoint, s.hf, mesh, rules, s.dtype,
                                                                step=s.step)
    evaluate = spec.run
    if model_info.task(config) != "lm":
        if spec.language_model:
            raise UserError(f"--task {s.task} scores a language model; this model does {model_info.task(config)}")
        evaluate = evaluate_labelled_run  # a labelled model's own task
    return _finish(s, evaluate(s, whole_run, recorded, config, params, mesh, rules, tokenizer))


def evaluate_text_run(s: EvalSettings, run: dict, recorded: dict, config, params, mesh, rules, tokenizer) -> dict:
    """``--task lm``: loss, perplexity and token accuracy over a split of the data."""
    from shardzoo.data import make_eval_dataset

    program, params, add_bos = text_program(s, recorded, config, params, mesh, rules, tokenizer,
                                            lambda add_bos, max_len: default_seq_len(config, recorded.get("seq_len")))
    data_config, split = data_config_of_eval(s, recorded, tokenizer, add_bos)
    seed = s.seed if s.seed is not None else recorded.get("seed", 0)
    batches = make_eval_dataset(data_config, tokenizer, program.seq_len, program.batch_size, split=split, seed=seed,
                                mesh=mesh, rules=rules)
    metrics = {**evaluate_lm(program, params, batches), "split": split}
    if split != "all":
        metrics.update(eval_fraction=data_config.eval_fraction, seed=seed)
    metrics.update(data=data_config.data, model=s.checkpoint or s.hf, batch_size=program.batch_size,
                   seq_len=program.seq_len, add_bos=bool(add_bos), rules=rules.name, mesh=describe_mesh(mesh))
    return metrics


@dataclasses.dataclass(frozen=True)
class EvalTask:
    """One ``shardzoo eval --task``: ``run(settings, run.json, recorded data settings, config,
    params, mesh, rules, tokenizer) -> metrics``, the flags only it takes, whether it needs a
    language model (else a labelled model is evaluated on its own task), a check of the flags
    before the model loads, and ``format(metrics)``, its one line."""

    run: Callable
    format: Callable
    flags: tuple[str, ...] = ()
    language_model: bool = False
    check: Callable | None = None


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


def format_lm(metrics: dict) -> str:
    return (f"eval over {metrics['tokens']} tokens in {metrics['batches']} batches: loss "
            f"{metrics['loss']:.4f}, perplexity {metrics['perplexity']:.4f}, token accuracy "
            f"{metrics['token_accuracy']:.4f}")


EVAL_TASKS = {
    "lm": EvalTask(evaluate_text_run, format_lm),
    "multiple-choice": EvalTask(evaluate_choices_run, format_choices, ("target_delimiter",), check=check_choices),
    "dpo": EvalTask(evaluate_preference_run, format_preference, ("reference",), language_model=True),
    "kto": EvalTask(evaluate_preference_run, format_preference, ("reference",), language_model=True),
    "rewards": EvalTask(evaluate_rewards_run, format_rewards, REWARD_FLAGS, language_model=True),
    "reward": EvalTask(evaluate_preference_run, format_preference, language_model=True),
}
FORMATS = {**{name: t.format for name, t in EVAL_TASKS.items()}, "classification": format_labelled,
           "regression": format_labelled}


def format_metrics(metrics: dict) -> str:
    """One line of the headline numbers (``metrics["task"]``'s)."""
    return FORMATS.get(metrics["task"], format_lm)(metrics)
