"""``shardzoo eval`` of a classification or regression run: its loss (and accuracy over all
and per class) over a split of its labelled data."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from shardzoo.data import DataConfig
from shardzoo.errors import UserError
from shardzoo.sharding.mesh import describe_mesh
from shardzoo.train import model_info
from shardzoo.train.eval_common import data_config_of_eval, eval_progress
from shardzoo.train.program import Program
from shardzoo.train.tasks.base import summarize_eval


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

    from shardzoo.train.tasks.base import forward

    step = program.compiled_eval_step()
    classify = program.task.has_accuracy  # classification (regression has no classes)
    if classify:
        predict = program.compile(
            lambda p, b: jnp.argmax(forward(program.task, program.module, p, b, jax.random.PRNGKey(0), True)[0], -1),
            program.abstract.params, program.abstract_batch,
            in_shardings=(program.shardings.params, program.batch_shardings))
    totals, count = {}, 0
    seen = correct = None
    with eval_progress(getattr(batches, "batches_per_epoch", None), "eval") as bar:
        for batch in batches:
            placed = program.place(batch)
            for key, value in jax.device_get(step(params, placed)).items():
                totals[key] = totals.get(key, 0.0) + float(value)
            if classify:
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


def evaluate_labelled_run(s, run: dict, recorded: dict, config, params, mesh, rules, tokenizer) -> dict:
    """``shardzoo eval`` of a classification or regression run on its recorded data (or --data)."""
    from shardzoo.data.batches import LabelledBatchIterator
    from shardzoo.train.io.sources import READS_RUNS, open_source

    if s.checkpoint is None or "label_column" not in recorded:
        raise UserError(f"eval of a {model_info.task(config)} model needs --checkpoint of the run "
                        "that trained it (its run.json names the label column)")
    names = run_classes(open_source(s.checkpoint, step=s.step, what="--checkpoint", accept=READS_RUNS).meta)
    data_config, split = data_config_of_eval(s, recorded, tokenizer, False)
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


def format_labelled(metrics: dict) -> str:
    if metrics["task"] == "regression":
        return f"regression over {metrics['examples']} examples: mse {metrics['loss']:.6g}"
    per_class = ", ".join(f"{name} {c['accuracy']:.4f} of {c['examples']}"
                          for name, c in metrics["per_class"].items() if c["examples"])
    return (f"classification over {metrics['examples']} examples: accuracy {metrics['accuracy']:.4f}, "
            f"loss {metrics['loss']:.4f}; per class: {per_class}")
