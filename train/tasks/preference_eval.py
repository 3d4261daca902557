"""``shardzoo eval --task dpo|kto|reward``: a preference task's loss and TRL's metrics over
preference pairs (or KTO's rows), against the reference the run trained with.

What differs by task is the task component's own (``tasks/registry.py``'s ``RUN_TASKS``):
``eval_task_of`` (the task rebuilt from the run's settings, or a refusal), ``unpaired`` (KTO's
rows), ``eval_rows`` (what the metrics count), ``eval_details`` and ``format_eval``."""

from __future__ import annotations

import os

import jax
import numpy as np

from shardzoo.data import DataConfig
from shardzoo.errors import UserError
from shardzoo.sharding.mesh import describe_mesh
from shardzoo.train import model_info
from shardzoo.train.defaults import default_seq_len
from shardzoo.train.eval_common import eval_progress
from shardzoo.train.program import Program
from shardzoo.train.step import merge_sums
from shardzoo.train.tasks.base import summarize_eval
from shardzoo.train.tasks.registry import RUN_TASKS


def evaluate_preference(program: Program, params, reference, batches, rows: str = "pairs") -> dict:
    """A preference task's loss and TRL's ``rewards/*`` and ``logps/*`` over every pair of
    ``batches``, against ``reference`` (a frozen copy's params; None: ``params`` themselves, whose
    LoRA adapters the reference step switches off), summed in float64 on the host; ``rows``: what
    the count of weighted rows is called."""
    step, totals, count = program.compiled_eval_step(), {}, 0
    ref_step = program.compiled_reference_step() if program.task.reference_keys else None
    with eval_progress(getattr(batches, "batches_per_epoch", None), "eval") as bar:
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
    return {"task": program.task.name, "loss": summary.pop("eval_loss"), rows: int(round(totals["weight"])),
            "batches": count, **{k.removeprefix("eval_"): v for k, v in summary.items()}}


def _reference_params(program: Program, task_settings: dict, model_settings: dict, seed: int, s):
    """The reference a DPO run trained against, placed as ``program``'s params: ``--reference``
    (eval's, else the run's), else its ``--init-from``, else the seed's initial params; None
    where the reference step runs the policy itself (``program.reference`` "adapters") or the
    loss has no reference."""
    from shardzoo.train.io.hub import is_hub_id
    from shardzoo.train.tasks.preference import load_reference

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


def evaluate_preference_run(s, run: dict, recorded: dict, config, params, mesh, rules, tokenizer) -> dict:
    """``shardzoo eval`` of a preference (``--task dpo``) run, or of a model with ``--task dpo``:
    its loss and reward metrics on preference pairs (the run's held-out pairs with ``--split
    eval``), against the reference it trained with; ``--task reward``: a reward model's loss and
    TRL's accuracy, margin and min/mean/max rewards on the pairs (no reference)."""
    from shardzoo.data import make_preference_eval_dataset

    settings = run.get("settings") or {}
    task_settings, data_settings = settings.get("task") or {}, settings.get("data") or {}
    model_settings = settings.get("model") or {}
    component = RUN_TASKS[s.task]
    task = component.eval_task_of(task_settings, s, config)
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
                             preference=True, unpaired=component.unpaired, skip_missing=recorded.get("skip_missing", False),
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
    metrics = {**evaluate_preference(program, params, ref_params, batches, component.eval_rows), "split": split,
               **component.eval_details(task, reference)}
    if split != "all":
        metrics.update(eval_fraction=fraction, seed=seed)
    metrics.update(data=data, model=s.checkpoint or s.hf, batch_size=batch_size, seq_len=seq_len,
                   rules=rules.name, mesh=describe_mesh(mesh))
    return metrics


def format_preference(metrics: dict) -> str:
    """The one line of a preference task's metrics, in its component's words."""
    return RUN_TASKS[metrics["task"]].format_eval(metrics)
