"""Preference fine-tuning as a task: DPO and its variants (TRL's losses, TRL's metric names).

The batch is ``data/preference.py``'s: per pair two sequences (chosen, rejected) ``[batch, 2,
length]``, their completion-token mask ``loss_mask``, the pair ``weights`` and ``truncated`` flags
``[batch]``, and the reference model's summed completion log-probabilities ``ref_logps [batch,
2]`` (filled in before the step by the program's reference step, or stored with the run by
``--precompute-reference``). The model sees the pairs as ``[2 * batch, length]`` rows, a reshape
that keeps each device's rows on it.

``loss`` (TRL's ``loss_type``, one or several comma-separated, summed with ``loss_weights`` as
TRL's MPO; ``beta``, ``label_smoothing`` and the rest as TRL's ``DPOConfig``/``CPOConfig``): with
``d = (pc - rc) - (pr - rr)`` (summed completion log-probs of policy ``p`` and reference ``r``),
each of TRL 1.16 DPOTrainer's losses term by term (``sigmoid`` smoothed by ``label_smoothing`` as
conservative DPO; ``ipo`` and ``sigmoid_norm`` on log-ratios per completion token; ``aot`` sorts
over the batch, the fill-up pairs last; ``sft`` the chosen tokens' NLL over the batch). ``ld_alpha``
(LD-DPO) weights the tokens past the shorter completion's length in the summed log-probs of
policy and reference; ``f_divergence_type`` (f-DPO) replaces each log-ratio by ``f'`` of the ratio
in the losses built on ``d``; ``use_weighting`` (WPO, Eq. 2 of its paper, as TRL) multiplies each
pair's loss by ``w_chosen w_rejected``, ``w = exp(mean over the completion's tokens of log p(token) -
log sum_v p(v)^2)`` without gradient (``sft``'s batch NLL by the pairs' mean weight; exact with one
micro-batch). Without a reference:

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
import math

import jax
import jax.numpy as jnp

from shardzoo.errors import UserError
from shardzoo.models.tiled_loss import token_stats
from shardzoo.sharding import axes as ax
from shardzoo.train import model_info
from shardzoo.train.jit import zeros_on
from shardzoo.train.tasks.base import Field, Task
from shardzoo.train.tasks.component import RunTask, language_model_only
from shardzoo.train.tasks.settings import DPO_SETTINGS

LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
          "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
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


def ld_mask(loss_mask, ld_alpha: float):
    """LD-DPO's token weights (TRL's ``ld_alpha``): 1 on the first ``min(chosen, rejected)``
    completion tokens of each sequence (the shared length), ``ld_alpha`` on the rest."""
    mask = loss_mask.astype(jnp.float32)  # [batch, 2, length]
    position = jnp.cumsum(mask, axis=-1)
    shared = jnp.min(jnp.sum(mask, axis=-1), axis=1)[:, None, None]  # [batch, 1, 1]
    return mask * jnp.where(position <= shared, 1.0, ld_alpha)


def f_scores(ratios, kind: str, alpha: float):
    """The f-DPO scores of the log-ratios (TRL's ``f_divergence_type``): ``f'(pi / ref)``."""
    if kind == "forward_kl":
        return 1.0 - jnp.exp(-ratios)
    if kind == "js_divergence":
        return math.log(2.0) + jax.nn.log_sigmoid(ratios)
    if kind == "alpha_divergence" and abs(alpha - 1.0) >= 1e-6:
        return (jnp.exp(jnp.minimum((alpha - 1.0) * ratios, 80.0)) - 1.0) / (alpha - 1.0)
    return ratios  # reverse_kl (and the alpha -> 1 limit)


def wpo_weights(logits, batch):
    """WPO's pair weights ``[batch]`` (TRL's ``use_weighting``): the product over a pair's two
    sequences of ``exp(mean over completion tokens of log p(target) - log sum_v p(v)^2)``, from
    the model's ``[2 * batch, length, vocab]`` logits, without gradient."""
    logp = jax.nn.log_softmax(jax.lax.stop_gradient(logits).astype(jnp.float32), axis=-1)
    targets = batch["targets"].reshape((-1,) + batch["targets"].shape[2:])
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    aligned = (picked - jax.nn.logsumexp(2.0 * logp, axis=-1))  # [2 * batch, length]
    mask = batch["loss_mask"].astype(jnp.float32)  # [batch, 2, length]
    mean = jnp.sum(aligned.reshape(mask.shape) * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)
    return jnp.prod(jnp.exp(mean), axis=1)


def _sorted_valid(x, valid):
    """``x`` sorted over the batch with the invalid (fill-up) pairs last."""
    return jnp.sort(jnp.where(valid, x, jnp.inf))


@dataclasses.dataclass(frozen=True)
class PreferenceTask(Task):
    """DPO and its variants on preference pairs (see the module docstring)."""

    loss: str = "sigmoid"  # one of LOSSES, or several comma-separated (combined with loss_weights)
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 0.0
    loss_weights: tuple[float, ...] | None = None
    ld_alpha: float | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05
    use_weighting: bool = False
    rows_per_example = 2  # a pair (KTO: a row and its mismatched KL row)

    @property
    def losses(self) -> tuple[str, ...]:
        return tuple(self.loss.split(","))

    @property
    def tiles_head(self) -> bool:
        return not self.use_weighting  # the loss reads the targets' log-probabilities (WPO: every token's)

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

    def _logps(self, outputs, batch):
        """``(log-probs as the loss sees them, plain summed log-probs, completion tokens)``, each
        ``[batch, 2]``; the first is LD-DPO's weighted sum with ``ld_alpha``."""
        logps, tokens = sequence_logps(outputs, batch)
        if self.ld_alpha is None:
            return logps, logps, tokens
        weighted, _ = sequence_logps(outputs, {**batch, "loss_mask": ld_mask(batch["loss_mask"], self.ld_alpha)})
        return weighted, logps, tokens

    def sums(self, outputs, batch, totals=None) -> dict:
        """Weighted sums over the pairs; ``sums[k] / sum(weights)`` is the step's ``k`` (the NLL
        term is scaled so that it averages over the step's chosen tokens, as TRL's)."""
        totals = self.step_totals(batch) if totals is None else totals
        w = batch["weights"].astype(jnp.float32)
        logps, plain, tokens = self._logps(outputs, batch)  # [batch, 2]
        nll = -jnp.sum(plain[:, 0] * w) * totals["pairs"] / totals["chosen_tokens"]
        extra = {}
        if self.uses_reference:
            ratios = logps - batch["ref_logps"].astype(jnp.float32)  # [batch, 2]
            rewards = self.beta * ratios
            weights = self.loss_weights or (1.0,) * len(self.losses)
            pair = wpo_weights(outputs, batch) if self.use_weighting else jnp.ones_like(w)  # [batch]
            loss = 0.0
            for name, weight in zip(self.losses, weights, strict=True):
                if name == "sft":
                    term = nll * jnp.sum(pair * w) / totals["pairs"] if self.use_weighting else nll
                else:
                    term = jnp.sum(self._pair_losses(name, ratios, logps, batch, tokens, w) * pair * w)
                loss = loss + weight * term
            shown = logps
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

    def _pair_losses(self, name, ratios, logps, batch, tokens, w):
        """Loss ``name``'s per-pair losses ``[batch]`` (TRL's DPOTrainer, term by term)."""
        beta, ls = self.beta, self.label_smoothing
        scores = f_scores(ratios, self.f_divergence_type, self.f_alpha_divergence_coef)
        z = beta * (scores[:, 0] - scores[:, 1])
        cr, rr = beta * ratios[:, 0], beta * ratios[:, 1]
        sig = jax.nn.log_sigmoid
        if name == "sigmoid":
            return self._smoothed(z)
        if name == "hinge":
            return jax.nn.relu(1.0 - z)
        if name in ("ipo", "sigmoid_norm"):
            per_token = scores / jnp.maximum(tokens, 1.0)
            d = per_token[:, 0] - per_token[:, 1]
            return (d - 1.0 / (2.0 * beta)) ** 2 if name == "ipo" else -sig(beta * d)
        if name == "exo_pair":
            return (jax.nn.sigmoid(z) * (sig(z) - math.log1p(-ls))
                    + jax.nn.sigmoid(-z) * (sig(-z) - math.log(ls)))
        if name == "nca_pair":
            return -sig(cr) - 0.5 * sig(-cr) - 0.5 * sig(-rr)
        if name == "robust":
            return (-(1.0 - ls) * sig(z) + ls * sig(-z)) / (1.0 - 2.0 * ls)
        if name == "bco_pair":
            return -sig(cr) - sig(-rr)
        if name == "sppo_hard":
            return (ratios[:, 0] - 0.5 / beta) ** 2 + (ratios[:, 1] + 0.5 / beta) ** 2
        if name in ("aot", "aot_unpaired"):
            valid = w > 0  # fill-up pairs sort last in both lists, so the real pairs' ranks still match
            if name == "aot":
                ref = batch["ref_logps"].astype(jnp.float32)
                a, b = logps[:, 0] - logps[:, 1], ref[:, 0] - ref[:, 1]
            else:
                a, b = ratios[:, 0], ratios[:, 1]
            ranked = jnp.sort(jnp.where(valid, 0.0, 1.0))  # 0 for the first sum(valid) ranks
            delta = jnp.where(ranked == 0.0, _sorted_valid(a, valid) - _sorted_valid(b, valid), 0.0)
            return self._smoothed(beta * delta)
        if name == "apo_zero":
            return 1.0 - jax.nn.sigmoid(cr) + jax.nn.sigmoid(rr)
        if name == "apo_down":
            return jax.nn.sigmoid(cr) + 1.0 - jax.nn.sigmoid(beta * (ratios[:, 0] - ratios[:, 1]))
        # discopop
        modulation = jax.nn.sigmoid(z / self.discopop_tau)
        return -sig(z) * (1.0 - modulation) + jnp.exp(-z) * modulation

    def _smoothed(self, z):
        ls = self.label_smoothing
        return -(1.0 - ls) * jax.nn.log_sigmoid(z) - ls * jax.nn.log_sigmoid(-z)

    def extra_metrics(self, sums, total_weight) -> dict:
        """The step's means of the pair sums (``pairs_truncated`` stays a count)."""
        out = {k: v / total_weight for k, v in sums.items() if "/" in k or k.startswith(("nll", "log_odds"))}
        out["pairs_truncated"] = sums["pairs_truncated"]
        return out

    def reference_logps(self, outputs, batch):
        """The reference's ``ref_logps`` entry from its logits on the pairs (LD-DPO's weighted sum
        with ``ld_alpha``)."""
        return self._logps(outputs, batch)[0]


def preference_task(loss: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0,
                    simpo_gamma: float = 0.5, cpo_alpha: float = 0.0, loss_weights=None, ld_alpha=None,
                    f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 0.5,
                    discopop_tau: float = 0.05, use_weighting: bool = False) -> PreferenceTask:
    """The ``dpo`` task with one or more (comma-separated) of ``LOSSES``; bad settings are
    one-line UserErrors (TRL's checks)."""
    losses = tuple(x.strip() for x in str(loss).split(","))
    for name in losses:
        if name not in LOSSES:
            raise UserError(f"--loss {name!r}: choose one or more (comma-separated) of {', '.join(LOSSES)}")
    if len(losses) > 1 and set(losses) & set(REFERENCE_FREE):
        raise UserError(f"--loss {loss}: {'/'.join(REFERENCE_FREE)} use no reference and do not combine")
    if len(set(losses)) != len(losses):
        raise UserError(f"--loss {loss}: names a loss twice")
    if loss_weights is not None:
        loss_weights = tuple(float(x) for x in loss_weights)
        if len(loss_weights) != len(losses):
            raise UserError(f"--loss-weights has {len(loss_weights)} values for {len(losses)} --loss types")
    if not beta > 0:
        raise UserError(f"--beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise UserError(f"--label-smoothing must be in [0, 0.5), got {label_smoothing}")
    if "exo_pair" in losses and label_smoothing == 0.0:
        raise UserError("--loss exo_pair needs --label-smoothing > 0 (the EXO paper's epsilon, e.g. 1e-3)")
    if cpo_alpha < 0:
        raise UserError(f"--cpo-alpha must be 0 or more, got {cpo_alpha}")
    if ld_alpha is not None and not 0.0 <= ld_alpha <= 1.0:
        raise UserError(f"--ld-alpha must be in [0, 1], got {ld_alpha}")
    if ld_alpha is not None and set(losses) & set(REFERENCE_FREE):
        raise UserError(f"--ld-alpha is a setting of the reference-based losses, not --loss {loss}")
    if f_divergence_type not in F_DIVERGENCES:
        raise UserError(f"--f-divergence-type {f_divergence_type!r}: choose one of {', '.join(F_DIVERGENCES)}")
    if f_divergence_type != "reverse_kl" and not set(losses) <= set(F_DIVERGENCE_LOSSES):
        raise UserError(f"--f-divergence-type {f_divergence_type} goes only with --loss "
                        f"{', '.join(F_DIVERGENCE_LOSSES)} (TRL's), not {loss}")
    if not discopop_tau > 0:
        raise UserError(f"--discopop-tau must be > 0, got {discopop_tau}")
    if use_weighting and set(losses) & {"aot", "aot_unpaired", *REFERENCE_FREE}:
        raise UserError(f"--use-weighting does not go with --loss {loss}: aot and aot_unpaired sort the pairs "
                        "(TRL refuses them), simpo and orpo are not DPOTrainer's")
    joined = ",".join(losses)
    return PreferenceTask("dpo", "pairs", f"{joined.replace(',', '_')}_loss", has_accuracy=False,
                          has_perplexity=False, signals=("rewards/accuracies", "rewards/margins"), loss=joined, beta=float(beta), label_smoothing=float(label_smoothing),
                          simpo_gamma=float(simpo_gamma), cpo_alpha=float(cpo_alpha), loss_weights=loss_weights,
                          ld_alpha=None if ld_alpha is None else float(ld_alpha),
                          f_divergence_type=f_divergence_type, f_alpha_divergence_coef=float(f_alpha_divergence_coef),
                          discopop_tau=float(discopop_tau), use_weighting=bool(use_weighting))


class DPORun(RunTask):
    """``--task dpo``: preference pairs, with the reference kind of ``Program.reference``:
    ``stored`` with ``--precompute-reference``, ``adapters`` for a LoRA policy without
    ``--reference``, else ``copy`` (a frozen copy); none for a reference-free loss."""

    name = eval_task = "dpo"
    preference = True

    def make(self, cfg, beta: float):
        return preference_task(cfg.loss or "sigmoid", beta, cfg.label_smoothing, cfg.simpo_gamma, cfg.cpo_alpha,
                               **{n: getattr(cfg, n) for n in DPO_SETTINGS})

    def task(self, cfg, config):
        language_model_only(cfg, config)
        task = self.make(cfg, 0.1 if cfg.beta is None else cfg.beta)
        if not task.uses_reference:
            if cfg.reference or cfg.precompute_reference:
                raise UserError(f"--loss {cfg.loss} uses no reference model: drop --reference/--precompute-reference")
            return task, None
        if cfg.precompute_reference:
            return task, "stored"
        return task, reference_kind(cfg, config)

    def datasets(self, cfg, data_config, tokenizer, mesh, rules, program):
        return pair_datasets(cfg, data_config, tokenizer, mesh, rules)

    def default(self):
        return preference_task()

    # ``shardzoo eval --task dpo`` (``tasks/preference_eval.py``): what its rows are, what its
    # metrics count, and the settings of run.json that its task is rebuilt from
    trained_on, eval_rows = "preference pairs", "pairs"
    recorded = ("loss", "beta", "label_smoothing", "simpo_gamma", "cpo_alpha", *DPO_SETTINGS)

    def from_settings(self, **settings):
        return preference_task(**settings)

    def eval_task_of(self, settings: dict, s, config):
        """The task ``shardzoo eval`` scores with: the run's (``settings``: run.json's task
        section; ``s``: eval's settings); a model that did not train on it needs ``--reference``."""
        if settings.get("task") != self.name and s.reference is None:
            raise UserError(f"--task {self.name} of a model that did not train on {self.trained_on} "
                            "needs --reference DIR")
        return self.from_settings(**{n: settings[n] for n in self.recorded if settings.get(n) is not None})

    def eval_details(self, task, reference) -> dict:
        """The eval's metrics beside the numbers: the loss, beta and the reference it scored against."""
        return {"loss_type": task.loss, "beta": task.beta, "reference": {
            "copy": "frozen copy", "adapters": "the base (adapters off)"}.get(reference, "none")}

    def format_eval(self, metrics: dict) -> str:
        return (f"dpo ({metrics['loss_type']}, beta {metrics['beta']:g}, reference: {metrics['reference']}) over "
                f"{metrics['pairs']} pairs: loss {metrics['loss']:.4f}, rewards/accuracies "
                f"{metrics['rewards/accuracies']:.4f}, rewards/margins {metrics['rewards/margins']:.4f}, "
                f"logps/chosen {metrics['logps/chosen']:.4f}, logps/rejected {metrics['logps/rejected']:.4f}")


def reference_kind(cfg, config) -> str:
    """The reference model of a task that has one: the LoRA base (adapters off) for a LoRA
    policy without ``--reference``, else a frozen copy (``Program.reference``)."""
    return "adapters" if model_info.lora_rank(config) and not cfg.reference else "copy"


def pair_datasets(cfg, data_config, tokenizer, mesh, rules):
    """``(train, eval or None)`` over the run's preference pairs (or KTO's rows)."""
    from shardzoo.data.loader import make_preference_datasets

    return make_preference_datasets(data_config, tokenizer, cfg.seq_len, cfg.batch_size, mesh=mesh, rules=rules,
                                    seed=cfg.seed)


def check_reference(path: str, config) -> None:
    """``--reference`` must name a model source of the policy's architecture (a one-line
    UserError naming the fields that differ, before anything is written)."""
    import dataclasses

    from shardzoo.train.io.sources import open_source

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
    from shardzoo.train.io.sources import open_source

    source = open_source(path, what="--reference")
    if not model_info.lora_rank(config):
        return source.load_params(target, config)
    adapters, base = split(target, is_adapter)
    zeros = zeros_on(adapters, jax.tree.map(lambda t: t.sharding, adapters))
    return join(zeros, source.load_params(base, config))
