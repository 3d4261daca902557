"""Tasks: what a batch holds, how the model is called on it, and the loss and metrics.

A task is the only place where the trainer meets the kind of model it trains; the program and
the Trainer never branch on a model family. Every task reports *sums* over the batch (loss,
weight, and e.g. correct guesses) so that gradient accumulation, evaluation over many batches
and multi-device reductions all divide once, by the total weight, at the end.

- ``lm``: next-token prediction. Batch ``inputs, targets, positions, segment_ids`` (int32) and
  ``weights`` (float32 loss mask), each ``[batch, length]``.
- ``classification``: ``inputs`` float32 ``[batch, features]``, ``targets`` int32 ``[batch]``,
  ``weights`` float32 ``[batch]``; cross-entropy and accuracy.
- ``regression``: as classification with float32 ``targets [batch, outputs]``; mean squared
  error over the outputs of each example.
- ``dpo``: preference pairs (``train/tasks/preference.py``): ``[batch, 2, length]`` sequences, a pair
  weight, and the reference model's log-probabilities, which a reference step of the program
  fills in before the train step (``reference_keys``).
- ``kto``: unpaired rows (``train/tasks/kto.py``'s KTOTask): the ``dpo`` layout, each row's
  second sequence its mismatched KL row, and a ``labels [batch]`` entry (1: desirable).
- ``grpo``: completions sampled from prompts and scored by reward functions (``train/tasks/grpo.py``):
  ``[batch, length]`` sequences, a completion-token mask, each completion's advantage, and the
  old policy's and the reference's per-token log-probabilities where the loss uses them.
- ``rloo``: GRPO's batch, RLOO's leave-one-out advantages and sequence-level loss (``train/tasks/grpo.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from shardzoo.errors import UserError
from shardzoo.models.tiled_loss import HeadInputs, weighted_nll
from shardzoo.sharding import axes as ax


@dataclasses.dataclass(frozen=True)
class Field:
    """One batch entry: its shape, dtype and the logical names of its dimensions."""

    shape: tuple[int, ...]
    dtype: str
    names: tuple


@dataclasses.dataclass(frozen=True)
class Task:
    """A task's batch layout, model call and loss (see the module docstring)."""

    name: str
    weight_name: str  # what the summed weight counts: "tokens" or "examples"
    loss_name: str  # the task loss's metric name: "ce_loss" or "mse"
    has_accuracy: bool
    has_perplexity: bool
    # the metrics that show what the task learns from (shell patterns over metric names, e.g.
    # ``rewards/*/mean``): the console, the progress bar, the final line and ``shardzoo plot``
    # show them beside the loss
    signals: tuple[str, ...] = ()

    # what the plan counts: sequences per example (a preference pair: two), whether the examples
    # are sequences of ``seq_len`` tokens, and whether a step samples completions (GRPO)
    rows_per_example = 1
    has_sequence = True
    samples = False
    teacher_samples = False  # distillation whose teacher samples completions too (--seq-kd)

    def fields(self, config, batch_size: int, seq_len: int | None) -> dict[str, Field]:
        """The batch's entries for ``batch_size`` rows of ``seq_len`` tokens each."""
        bl = (ax.BATCH, ax.LENGTH)
        shape = (batch_size, seq_len)
        fields = {k: Field(shape, "int32", bl) for k in ("inputs", "targets", "positions", "segment_ids")}
        fields["weights"] = Field(shape, "float32", bl)
        return fields

    def model_args(self, batch) -> tuple[tuple, dict]:
        """The positional and keyword arguments of the model call on ``batch``."""
        return (batch["inputs"],), {"positions": batch["positions"], "segment_ids": batch["segment_ids"]}

    @property
    def tiles_head(self) -> bool:
        """Whether the loss reads only per-token statistics of the logits (their logsumexp, the
        target's logit), so a model may leave its head to the loss (``models/tiled_loss.py``)."""
        return True

    def step_totals(self, batch):
        """What a task needs of the step's whole batch besides its weight (None: nothing)."""
        return None

    def extra_metrics(self, sums, total_weight) -> dict:
        """Metrics of the step beyond loss and accuracy, from its summed ``sums``."""
        return {}

    @property
    def reference_keys(self) -> tuple[str, ...]:
        """Batch entries a reference model fills in before the step (preference tasks)."""
        return ()

    @property
    def later_keys(self) -> tuple[str, ...]:
        """Batch entries the program computes on the device before the train step (a batch from
        the host may lack them): the reference's, and GRPO's old policy log-probs."""
        return self.reference_keys

    def sums(self, outputs, batch) -> dict:
        """``loss`` (weighted sum of per-example/token losses), ``weight``, and ``correct``."""
        weights = batch["weights"].astype(jnp.float32)
        if isinstance(outputs, HeadInputs):  # the model left its head to the tiled loss
            loss, stats = weighted_nll(outputs, batch["targets"], weights)
            correct = (stats.target >= stats.max).astype(jnp.float32)
            return {"loss": loss, "weight": jnp.sum(weights),
                    "correct": jnp.sum(correct * weights)}
        outputs = outputs.astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(outputs, batch["targets"])
        correct = (jnp.argmax(outputs, axis=-1) == batch["targets"]).astype(jnp.float32)
        return {"loss": jnp.sum(losses * weights), "weight": jnp.sum(weights),
                "correct": jnp.sum(correct * weights)}


@dataclasses.dataclass(frozen=True)
class ClassificationTask(Task):
    """Labelled examples: ``inputs [batch, features]``, int32 ``targets [batch]``; cross-entropy."""

    has_sequence = False
    outputs_are = "classes"  # what a model's num_outputs stand for

    def _targets(self, config, batch_size: int) -> Field:
        return Field((batch_size,), "int32", (ax.BATCH,))

    def learns(self, needed: int, num_outputs: int) -> bool:
        """Whether a model of ``num_outputs`` outputs can learn labels that need ``needed``
        (the data's ``num_outputs``): a logit per class, more allowed."""
        return needed <= num_outputs

    def fields(self, config, batch_size: int, seq_len: int | None) -> dict[str, Field]:
        (features,) = config.sample_inputs(batch_size, seq_len)
        return {
            "inputs": Field(tuple(features.shape), "float32", (ax.BATCH,) + (None,) * (len(features.shape) - 1)),
            "targets": self._targets(config, batch_size),
            "weights": Field((batch_size,), "float32", (ax.BATCH,)),
        }

    def model_args(self, batch) -> tuple[tuple, dict]:
        return (batch["inputs"],), {}

    @property
    def tiles_head(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class RegressionTask(ClassificationTask):
    """As classification with float32 ``targets [batch, outputs]``; the mean squared error over
    each example's outputs."""

    outputs_are = "outputs"

    def learns(self, needed: int, num_outputs: int) -> bool:
        """Exactly the targets' width."""
        return needed == num_outputs

    def _targets(self, config, batch_size: int) -> Field:
        return Field((batch_size, config.num_outputs), "float32", (ax.BATCH, None))

    def sums(self, outputs, batch) -> dict:
        weights = batch["weights"].astype(jnp.float32)
        losses = jnp.mean((outputs.astype(jnp.float32) - batch["targets"]) ** 2, axis=-1)  # [batch]
        return {"loss": jnp.sum(losses * weights), "weight": jnp.sum(weights)}

TASKS = {
    "lm": Task("lm", "tokens", "ce_loss", has_accuracy=True, has_perplexity=True),
    "classification": ClassificationTask("classification", "examples", "ce_loss", has_accuracy=True,
                           has_perplexity=False, signals=("accuracy",)),
    "regression": RegressionTask("regression", "examples", "mse", has_accuracy=False, has_perplexity=False),
}


def model_task(config) -> Task:
    """The task a model config trains by itself (its ``task`` field: ``lm``, ``classification``
    or ``regression``); the run tasks (``--task dpo`` and the rest) are ``tasks/registry.py``'s."""
    name = getattr(config, "task", None)
    if name not in TASKS:
        raise UserError(f"task {name!r} is not one of {', '.join(TASKS)}")
    return TASKS[name]


def forward(task: Task, module, params, batch, rng, deterministic: bool, extra: tuple[str, ...] = ()):
    """``(outputs, aux_loss or None, model_metrics)``: one model call per the zoo's contract.

    ``aux_loss`` sums the model's ``losses`` collection (MoE router losses, already weighted);
    ``model_metrics`` averages each sown ``metrics`` entry over layers and calls. With
    ``extra`` collections (e.g. ``router_load``), a fourth item: those collections as sown.
    ``outputs`` are ``HeadInputs`` in place of logits where the task and the model's
    ``execution.tiled_loss`` tile the head (``models/tiled_loss.py``).
    """
    args, kwargs = task.model_args(batch)
    tiles = getattr(module, "tiles_loss", None)  # zoo Transformers; a toy module has none
    if task.tiles_head and tiles is not None and tiles(args[0].size):
        kwargs["head"] = False
    outputs, collections = module.apply(
        {"params": params}, *args, **kwargs, deterministic=deterministic,
        rngs={"dropout": rng}, mutable=["losses", "metrics", *extra],
    )
    losses = jax.tree.leaves(collections.get("losses", {}))
    aux = sum(jnp.sum(x.astype(jnp.float32)) for x in losses) if losses else None
    model_metrics = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(collections.get("metrics", {}))[0]:
        name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
        model_metrics.setdefault(name, []).append(jnp.ravel(leaf.astype(jnp.float32)))
    model_metrics = {k: jnp.mean(jnp.concatenate(v)) for k, v in model_metrics.items()}
    if extra:
        return outputs, aux, model_metrics, {c: collections.get(c, {}) for c in extra}
    return outputs, aux, model_metrics


def summarize_eval(task: Task, totals: dict) -> dict:
    """Eval loss (and perplexity, accuracy where the task has them) from summed eval sums."""
    weight = max(float(totals["weight"]), 1e-8)
    loss = float(totals["loss"]) / weight
    out = {"eval_loss": loss}
    if task.has_perplexity:
        out["eval_perplexity"] = float(jnp.exp(jnp.minimum(loss, 80.0)))
    if task.has_accuracy:
        out["eval_accuracy"] = float(totals["correct"]) / weight
    out.update({f"eval_{k}": float(v) for k, v in task.extra_metrics(totals, weight).items()})
    return out
