"""Preference fine-tuning as a task: DPO and its variants (TRL's losses, TRL's metric names).

The batch is ``data/preference.py``'s: per pair two sequences (chosen, rejected) ``[batch, 2,
length]``, their completion-token mask ``loss_mask``, the pair ``weights`` and ``truncated`` flags
``[batch]``, and the reference model's summed completion log-probabilities ``ref_logps [batch,
2]`` (filled in before the step by the program's reference step, or stored with the run by
``--precompute-reference``). The model sees the pairs as ``[2 * batch, length]`` rows, a reshape
that keeps each device's rows on it.

``loss`` (TRL's ``loss_type``; ``beta``, ``label_smoothing`` as TRL's ``DPOConfig``/``CPOConfig``):

- ``sigmoid`` (DPO): ``-(1-ls) logsig(beta d) - ls logsig(-beta d)``, ``d = (pc - rc) - (pr - rr)``
  (summed completion log-probs of policy ``p`` and reference ``r``; ``ls = 0`` is TRL's ``sigmoid``,
  ``ls > 0`` conservative DPO);
- ``hinge``: ``relu(1 - beta d)``;
- ``ipo``: ``((pc - rc) / nc - (pr - rr) / nr - 1 / (2 beta))**2`` (log-ratios per completion token,
  as TRL's DPOTrainer);
- ``simpo`` (TRL's CPOTrainer ``loss_type="simpo"``): no reference; per-token average log-probs
  ``ac, ar``, ``-(1-ls) logsig(beta (ac - ar - gamma/beta)) - ls logsig(-...)``, plus ``cpo_alpha``
  times the chosen completions' NLL (per token over the batch; TRL's default 1.0, here 0);
- ``orpo`` (TRL's ORPOTrainer): no reference; ``NLL(chosen) - beta logsig(log_odds)``, ``log_odds =
  (ac - ar) - (log(1 - e^ac) - log(1 - e^ar))``.

Metrics (TRL's names): ``rewards/chosen``, ``rewards/rejected`` (``beta`` times the log-ratio, or
times the average log-prob without a reference), ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen``, ``logps/rejected``; ``nll_loss`` for simpo/orpo (and ``log_odds_ratio``,
``log_odds_chosen`` for orpo); ``pairs_truncated``: the step's pairs cut by a length limit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from shardzoo.errors import UserError
from shardzoo.models.tiled_loss import token_stats
from shardzoo.sharding import axes as ax
from shardzoo.train.tasks import Field, Task

LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
SEQ_KEYS = ("inputs", "targets", "positions", "segment_ids")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def log1mexp(x):
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2`` (as TRL's)."""
    t = -0.6931471805599453
    return jnp.where(x < t, jnp.log1p(-jnp.exp(jnp.minimum(x, t))), jnp.log(-jnp.expm1(jnp.maximum(x, t))))


def sequence_logps(outputs, batch):
    """``(summed completion log-probs [batch, 2], completion tokens [batch, 2])`` of the pairs'
    sequences from the model's ``[2 * batch, length, vocab]`` logits (or ``HeadInputs``: tiled)."""
    targets = batch["targets"].reshape((-1,) + batch["targets"].shape[2:])
    picked = token_stats(outputs, targets).logp  # [2 * batch, length]
    mask = batch["loss_mask"].astype(jnp.float32)  # [batch, 2, length]
    picked = picked.reshape(mask.shape)
    return jnp.sum(picked * mask, axis=-1), jnp.sum(mask, axis=-1)


@dataclasses.dataclass(frozen=True)
class PreferenceTask(Task):
    """DPO and its variants on preference pairs (see the module docstring)."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 0.0

    @property
    def tiles_head(self) -> bool:
        return True  # the loss reads the targets' log-probabilities only

    @property
    def uses_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE

    @property
    def reference_keys(self) -> tuple[str, ...]:
        """The batch entries the reference step fills in (none for reference-free losses)."""
        return ("ref_logps",) if self.uses_reference else ()

    def fields(self, config, batch_size: int, seq_len: int | None) -> dict[str, Field]:
        pair = (batch_size, 2, seq_len)
        names = (ax.BATCH, None, ax.LENGTH)
        fields = {k: Field(pair, "int32", names) for k in SEQ_KEYS}
        fields["loss_mask"] = Field(pair, "float32", names)
        fields["weights"] = Field((batch_size,), "float32", (ax.BATCH,))
        fields["truncated"] = Field((batch_size,), "float32", (ax.BATCH,))
        if self.uses_reference:
            fields["ref_logps"] = Field((batch_size, 2), "float32", (ax.BATCH, None))
        return fields

    def model_args(self, batch) -> tuple[tuple, dict]:
        rows = lambda x: x.reshape((-1,) + x.shape[2:])  # [batch, 2, length] -> [2 * batch, length]
        return (rows(batch["inputs"]),), {"positions": rows(batch["positions"]),
                                          "segment_ids": rows(batch["segment_ids"])}

    def step_totals(self, batch) -> dict:
        """What the step's whole batch holds (microbatches divide by it): pairs and chosen tokens."""
        w = batch["weights"].astype(jnp.float32)
        chosen = jnp.sum(batch["loss_mask"][:, 0].astype(jnp.float32), axis=-1)
        return {"pairs": jnp.maximum(jnp.sum(w), 1e-8), "chosen_tokens": jnp.maximum(jnp.sum(chosen * w), 1e-8)}

    def sums(self, outputs, batch, totals=None) -> dict:
        """Weighted sums over the pairs; ``sums[k] / sum(weights)`` is the step's ``k`` (the NLL
        term is scaled so that it averages over the step's chosen tokens, as TRL's)."""
        totals = self.step_totals(batch) if totals is None else totals
        w = batch["weights"].astype(jnp.float32)
        logps, tokens = sequence_logps(outputs, batch)  # [batch, 2]
        nll = -jnp.sum(logps[:, 0] * w) * totals["pairs"] / totals["chosen_tokens"]
        extra = {}
        if self.uses_reference:
            ratios = logps - batch["ref_logps"].astype(jnp.float32)  # [batch, 2]
            rewards = self.beta * ratios
            delta = ratios[:, 0] - ratios[:, 1]
            if self.loss == "sigmoid":
                losses = self._smoothed(self.beta * delta)
            elif self.loss == "hinge":
                losses = jax.nn.relu(1.0 - self.beta * delta)
            else:  # ipo: log-ratios per completion token
                per_token = ratios / jnp.maximum(tokens, 1.0)
                losses = (per_token[:, 0] - per_token[:, 1] - 1.0 / (2.0 * self.beta)) ** 2
            shown = logps
            loss = jnp.sum(losses * w)
        else:
            average = logps / jnp.maximum(tokens, 1.0)
            rewards, shown = self.beta * average, average
            if self.loss == "simpo":
                losses = self._smoothed(self.beta * (average[:, 0] - average[:, 1] - self.simpo_gamma / self.beta))
                loss = jnp.sum(losses * w) + self.cpo_alpha * nll
            else:  # orpo
                log_odds = (average[:, 0] - average[:, 1]) - (log1mexp(average[:, 0]) - log1mexp(average[:, 1]))
                ratio = jax.nn.log_sigmoid(log_odds)
                loss = nll - self.beta * jnp.sum(ratio * w)
                extra = {"log_odds_ratio": jnp.sum(ratio * w), "log_odds_chosen": jnp.sum(log_odds * w)}
            extra["nll_loss"] = nll
        margins = rewards[:, 0] - rewards[:, 1]
        return {
            "loss": loss, "weight": jnp.sum(w),
            "rewards/chosen": jnp.sum(rewards[:, 0] * w), "rewards/rejected": jnp.sum(rewards[:, 1] * w),
            "rewards/accuracies": jnp.sum((margins > 0).astype(jnp.float32) * w),
            "rewards/margins": jnp.sum(margins * w),
            "logps/chosen": jnp.sum(shown[:, 0] * w), "logps/rejected": jnp.sum(shown[:, 1] * w),
            "pairs_truncated": jnp.sum(batch["truncated"].astype(jnp.float32) * w),
            **extra,
        }

    def _smoothed(self, z):
        ls = self.label_smoothing
        return -(1.0 - ls) * jax.nn.log_sigmoid(z) - ls * jax.nn.log_sigmoid(-z)

    def extra_metrics(self, sums, total_weight) -> dict:
        """The step's means of the pair sums (``pairs_truncated`` stays a count)."""
        out = {k: v / total_weight for k, v in sums.items() if "/" in k or k.startswith(("nll", "log_odds"))}
        out["pairs_truncated"] = sums["pairs_truncated"]
        return out

    def reference_logps(self, outputs, batch):
        """The reference's ``ref_logps`` entry from its logits on the pairs."""
        return sequence_logps(outputs, batch)[0]


def preference_task(loss: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0,
                    simpo_gamma: float = 0.5, cpo_alpha: float = 0.0) -> PreferenceTask:
    """The ``dpo`` task with one of ``LOSSES``; bad settings are one-line UserErrors."""
    if loss not in LOSSES:
        raise UserError(f"--loss {loss!r}: choose one of {', '.join(LOSSES)}")
    if not beta > 0:
        raise UserError(f"--beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise UserError(f"--label-smoothing must be in [0, 0.5), got {label_smoothing}")
    if cpo_alpha < 0:
        raise UserError(f"--cpo-alpha must be 0 or more, got {cpo_alpha}")
    return PreferenceTask("dpo", "pairs", f"{loss}_loss", has_accuracy=False, has_perplexity=False,
                          signals=("rewards/accuracies", "rewards/margins"), loss=loss,
                          beta=float(beta), label_smoothing=float(label_smoothing),
                          simpo_gamma=float(simpo_gamma), cpo_alpha=float(cpo_alpha))


def run_task(cfg, config):
    """``(task, reference)`` of a run's settings (``cfg``, a TrainConfig) for the Program:
    the model's own task and no reference, or ``--task dpo``'s, with its reference kind
    (``Program.reference``): ``stored`` with ``--precompute-reference``, ``adapters`` for a LoRA
    policy without ``--reference``, else ``copy`` (a frozen copy)."""
    from shardzoo.train import model_info
    from shardzoo.train.tasks import get_task

    name = getattr(cfg, "task", None)
    if name in ("grpo", "rloo"):
        return _grpo_run_task(cfg, config)
    if name != "dpo":
        if name == "lm" and getattr(config, "task", "lm") != "lm":
            raise UserError(f"--task lm: the model does {config.task}, not language modelling")
        return get_task(config), None
    if getattr(config, "task", "lm") != "lm":
        raise UserError(f"--task dpo trains a language model; the model does {config.task}")
    beta = 0.1 if cfg.beta is None else cfg.beta
    task = preference_task(cfg.loss or "sigmoid", beta, cfg.label_smoothing, cfg.simpo_gamma, cfg.cpo_alpha)
    if not task.uses_reference:
        if cfg.reference or cfg.precompute_reference:
            raise UserError(f"--loss {cfg.loss} uses no reference model: drop --reference/--precompute-reference")
        return task, None
    if cfg.precompute_reference:
        return task, "stored"
    if model_info.lora_rank(config) and not cfg.reference:
        return task, "adapters"
    return task, "copy"


def _grpo_run_task(cfg, config):
    """``--task grpo``'s (or ``rloo``'s) task and reference: none with ``--beta 0``, else the LoRA
    base (adapters off) or a frozen copy, as DPO's."""
    from shardzoo.train import model_info
    from shardzoo.train.config import GRPO_OPTIONS
    from shardzoo.train.grpo import grpo_task
    from shardzoo.train.rollouts import completion_length

    if getattr(config, "task", "lm") != "lm":
        raise UserError(f"--task {cfg.task} trains a language model; the model does {config.task}")
    options = {n: getattr(cfg, n) for n in GRPO_OPTIONS} if cfg.task == "grpo" else {}
    task = grpo_task(cfg.loss, cfg.beta, cfg.epsilon, cfg.epsilon_high, cfg.num_iterations, completion_length(cfg),
                     name=cfg.task, **options)
    if not task.beta:
        if cfg.reference:
            raise UserError("--reference: --beta 0 uses no reference model (give --beta > 0 or drop --reference)")
        return task, None
    if model_info.lora_rank(config) and not cfg.reference:
        return task, "adapters"
    return task, "copy"


def check_reference(path: str, config) -> None:
    """``--reference`` must name a model source of the policy's architecture (a one-line
    UserError naming the fields that differ, before anything is written)."""
    import dataclasses

    from shardzoo.train.sources import open_source

    other = open_source(path, what="--reference").config
    mine, theirs = getattr(config, "arch", None), getattr(other, "arch", None)
    if mine is None or theirs is None or mine == theirs:
        return
    differ = [f"{f.name} {getattr(theirs, f.name)!r} (the policy's {getattr(mine, f.name)!r})"
              for f in dataclasses.fields(mine) if getattr(mine, f.name) != getattr(theirs, f.name)]
    raise UserError(f"--reference {path}: not the policy's architecture: {'; '.join(differ[:4])}")


def load_reference(path: str, target, config):
    """``--reference``'s params placed like ``target`` (the policy's params); under LoRA the
    adapters are zeros (the reference step switches them off anyway)."""
    from shardzoo.models.lora import is_adapter, join, split
    from shardzoo.train import model_info
    from shardzoo.train.sources import open_source

    source = open_source(path, what="--reference")
    if not model_info.lora_rank(config):
        return source.load_params(target, config)
    adapters, base = split(target, is_adapter)
    shardings = jax.tree.map(lambda t: t.sharding, adapters)
    zeros = jax.jit(lambda: jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), adapters),
                    out_shardings=shardings)()
    return join(zeros, source.load_params(base, config))
