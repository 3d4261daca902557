"""GRPO and RLOO as tasks: completions sampled on the training mesh, scored by reward functions, and
the losses of TRL's ``GRPOTrainer`` and ``RLOOTrainer`` (their names, their formulas).

A step (``GRPOTrainer.train_step``): every ``num_iterations`` steps a *rollout*: the next
``batch_size / G`` prompts, each repeated ``G = num_generations`` times, are continued by the
Program's compiled decoding (``Program.generate``) on the params the train step updates (the same
arrays, the same mesh and rules; the sampler compiles once), with the key
``fold_in(sampler_key, step)``; the completions are decoded, scored by every reward function,
and their weighted sum ``r`` becomes the advantage ``A = r - mean_group(r)`` (divided by the
group's std + 1e-4 with ``scale_rewards="group"``, the batch's with ``"batch"``; not with
``"none"``; TRL's ``multi_objective_aggregation``: ``normalize_then_sum`` normalises each function
in its group first, see ``group_rewards``). A function may return None for a completion it does not
apply to (left out of the sums and means; a completion no function scored gets advantage 0); with
``mask_truncated_completions`` a completion without an eos keeps its place in its group and leaves
the loss. The old policy's per-token log-probs (``num_iterations > 1``) and the reference's
(``beta > 0``) are computed once per rollout. The rollout is reused by ``num_iterations`` steps.

The batch (``[rows, length]``, a row = left-padded prompt + completion, ``length = seq_len``):
``inputs``, ``targets``, ``positions``, ``segment_ids`` (int32), ``loss_mask`` (float32: 1 where
the target is a completion token, its eos included), ``advantages``, ``weights`` ``[rows]`` and
``old_logps`` / ``ref_logps`` ``[rows, length]`` when used.

The loss (TRL 1.16's ``_compute_loss``), per completion token ``t`` with ``p_t`` the policy's
log-prob, ``o_t`` the old policy's (``stop_gradient(p_t)`` with one iteration: the ratio is exactly
1), ``q_t`` the reference's; the importance weight ``w = exp(p_t - o_t)`` per token, or with
``importance_sampling_level="sequence"`` (GSPO) ``exp`` of the completion's mean log-ratio::

    l_t = -min(w A, clip(w, 1 - eps, 1 + eps_high) A)         # grpo, bnpo, dr_grpo, dapo, luspo
    l_t = -stop_gradient(min(w, eps_high)) A p_t              # cispo
    l_t = -sigmoid(tau (w - 1)) 4 / tau A                     # sapo, tau by the sign of A
    l_t = -phi(w_seq) A p_t                                   # vespo, phi a gamma weight (no gradient)
    l_t += beta (exp(q_t - p_t) - (q_t - p_t) - 1) w          # k3 KL, beta > 0 (w: use_bias_correction_kl)

aggregated by ``loss`` (TRL's ``loss_type``): ``grpo`` and ``sapo`` the mean over completions of
each one's mean over its tokens; ``dapo`` (the default), ``bnpo``, ``cispo`` and ``vespo`` the mean
over the step's completion tokens; ``dr_grpo`` the sum over tokens divided by ``completions *
max_completion_length``; ``luspo`` the mean over completions of each one's sum. ``delta`` clamps
``w`` from above in the clipped losses, ``top_entropy_quantile`` keeps the policy term on the
batch's highest-entropy tokens, ``entropy_coef`` subtracts the mean entropy.

RLOO (``name="rloo"``, TRL's ``RLOOTrainer``): the KL is in the reward (``rloo_rewards``: the
first-order ``o_t - q_t`` summed per completion, times beta), the advantage is leave-one-out, and
the loss is the clipped ratio of the completion's summed log-probs, the mean over completions.

Metrics (TRL's names): ``reward``, ``reward_std``, ``rewards/<function>/mean`` and ``/std``,
``frac_reward_zero_std``, ``completions/mean_length`` (``min``, ``max``, ``clipped_ratio``),
``kl``, ``entropy``, ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``
(over completions at the sequence level and for RLOO), ``cispo_clip_ratio``,
``vespo/phi_seq_mean``, ``policy_loss`` and ``entropy_coef`` with an entropy bonus; and
``time/sampling_s``, ``time/scoring_s`` of the step's rollout; ``clip_ratio/low_min`` and
``high_max``: the min (max) over the step's completions of each one's share of low- (high-)
clipped tokens (TRL logs a mean of these over its gradient-accumulation micro-batches; here they
are over the whole step, the same with one micro-batch).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from shardzoo.errors import UserError
from shardzoo.models.tiled_loss import token_stats
from shardzoo.sharding import axes as ax
from shardzoo.train.tasks.base import Field, Task

LOSSES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")  # TRL 1.16's loss_type
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the PPO-clipped losses (their clip_ratio metrics)
LEVELS = ("token", "sequence")  # TRL's importance_sampling_level
SEQ_KEYS = ("inputs", "targets", "positions", "segment_ids")


def token_logps(outputs, targets, entropy_grad: bool = False):
    """``(each target's log-probability, the softmax's entropy)``, each ``[rows, length]``, from
    logits ``[rows, length, vocab]`` (or ``HeadInputs``: tiled, ``models/tiled_loss.py``). The
    entropy is a metric without gradient, but with ``entropy_grad`` (an ``--entropy-coef`` bonus,
    which differentiates it: from full logits, the task asking for no tiling)."""
    if entropy_grad:
        logp = jax.nn.log_softmax(outputs.astype(jnp.float32), axis=-1)  # [rows, length, vocab]
        target = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return target, -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    stats = token_stats(outputs, targets)
    return stats.logp, stats.entropy


def masked_row_mean(x, mask):
    """Per row, the mean of ``x`` over its masked tokens ``[rows, 1]`` (TRL: count clamped at 1)."""
    return jnp.sum(x * mask, -1, keepdims=True) / jnp.maximum(jnp.sum(mask, -1, keepdims=True), 1.0)


def gamma_weights(advantages, log_ratio, mask, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's ``phi(w) = e^lambda w^k e^(-lambda w)`` of the sequence ratio ``w`` ``[rows, 1]``,
    in log space and without gradient, as TRL's ``get_gamma_weights``."""
    lower = math.log(1e-8)
    seq = jnp.sum(jnp.clip(log_ratio, -20.0, 20.0) * mask, -1, keepdims=True)
    log_w = jnp.clip(seq, lower, 20.0)
    nonneg = advantages >= 0
    k = jnp.where(nonneg, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(nonneg, lambda_pos, lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jax.lax.stop_gradient(jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))


@dataclasses.dataclass(frozen=True)
class GRPOTask(Task):
    """The GRPO (or RLOO) loss on a rollout batch (see the module docstring)."""

    loss: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    num_iterations: int = 1
    max_completion_length: int = 64
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True
    delta: float | None = None
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    samples = True  # a step's completions are sampled from the policy (the plan's rollout cache)

    @property
    def kl_in_reward(self) -> bool:
        """RLOO puts its KL (first order, summed per completion) in the reward, GRPO in the loss."""
        return self.name == "rloo"

    @property
    def tiles_head(self) -> bool:
        # the loss reads the targets' log-probabilities and the entropy (a metric) tiles too; an
        # entropy bonus differentiates the entropy, from full logits
        return not self.entropy_coef

    @property
    def reference_keys(self) -> tuple[str, ...]:
        return ("ref_logps",) if self.beta else ()

    @property
    def later_keys(self) -> tuple[str, ...]:
        """Batch entries computed on the device after the rollout: old and reference log-probs (RLOO's
        KL in the reward needs the old policy's with one iteration too)."""
        old = self.num_iterations > 1 or (self.kl_in_reward and self.beta)
        return (("old_logps",) if old else ()) + self.reference_keys

    def fields(self, config, batch_size: int, seq_len: int | None) -> dict[str, Field]:
        rows, names = (batch_size, seq_len), (ax.BATCH, ax.LENGTH)
        fields = {k: Field(rows, "int32", names) for k in SEQ_KEYS}
        fields["loss_mask"] = Field(rows, "float32", names)
        fields["advantages"] = Field((batch_size,), "float32", (ax.BATCH,))
        fields["weights"] = Field((batch_size,), "float32", (ax.BATCH,))
        for key in self.later_keys:
            fields[key] = Field(rows, "float32", names)
        return fields

    def model_args(self, batch) -> tuple[tuple, dict]:
        return (batch["inputs"],), {"positions": batch["positions"], "segment_ids": batch["segment_ids"]}

    def step_totals(self, batch) -> dict:
        """The step's completions and completion tokens (bnpo, dapo, cispo, vespo and dr_grpo divide by them)."""
        w = batch["weights"].astype(jnp.float32)
        tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32) * w[:, None])
        return {"rows": jnp.maximum(jnp.sum(w), 1e-8), "tokens": jnp.maximum(tokens, 1.0)}

    def old_logps(self, logps, batch):
        """The old policy's per-token log-probs: the rollout's, or ``stop_gradient(logps)`` with
        one iteration (the ratio is exactly 1)."""
        return batch["old_logps"] if self.num_iterations > 1 else jax.lax.stop_gradient(logps)

    def per_token(self, logps, batch, mask=None):
        """``(per-token loss, coef_1, kl or None, extra)`` as TRL's ``_compute_loss`` before the
        aggregation; ``coef_1`` (the importance weight) is ``[rows, length]`` or, at the sequence
        level, ``[rows, 1]``; ``extra`` holds vespo's ``phi_seq``."""
        mask = batch["loss_mask"].astype(jnp.float32) if mask is None else mask
        advantages = batch["advantages"].astype(jnp.float32)[:, None]
        log_ratio = logps - self.old_logps(logps, batch)
        weights = log_ratio if self.importance_sampling_level == "token" else masked_row_mean(log_ratio, mask)
        coef_1 = jnp.exp(weights)
        kl = None
        if self.beta:
            delta = batch["ref_logps"] - logps
            kl = jnp.exp(delta) - delta - 1.0
            if self.use_bias_correction_kl:  # TRL's default: the KL times the importance weight
                kl = kl * coef_1
        extra = {}
        if self.loss == "cispo":
            loss = -jax.lax.stop_gradient(jnp.minimum(coef_1, self.epsilon_high)) * advantages * logps
        elif self.loss == "sapo":
            tau = jnp.where(advantages > 0, self.sapo_temperature_pos, self.sapo_temperature_neg)
            loss = -jax.nn.sigmoid(tau * (coef_1 - 1.0)) * 4.0 / tau * advantages
        elif self.loss == "vespo":
            extra["phi_seq"] = gamma_weights(advantages, log_ratio, mask, self.vespo_k_pos, self.vespo_lambda_pos,
                                             self.vespo_k_neg, self.vespo_lambda_neg)
            loss = -extra["phi_seq"] * advantages * logps
        else:
            coef_2 = jnp.clip(coef_1, 1.0 - self.epsilon, 1.0 + self.epsilon_high)
            if self.delta is not None:  # two-sided clipping (TRL's clip metrics then see the clamped ratio)
                coef_1 = jnp.minimum(coef_1, self.delta)
            loss = -jnp.minimum(coef_1 * advantages, coef_2 * advantages)
        return loss, coef_1, kl, extra

    def sums(self, outputs, batch, totals=None) -> dict:
        """Sums over the rows; ``sums["loss"] / sum(weights)`` is the step's loss (see the module
        docstring: some losses scale by the step's totals)."""
        if self.name == "rloo":
            return self.rloo_sums(outputs, batch)
        totals = self.step_totals(batch) if totals is None else totals
        w = batch["weights"].astype(jnp.float32)
        loss_mask = batch["loss_mask"].astype(jnp.float32)
        mask = loss_mask * w[:, None]  # [rows, length]
        logps, entropy = token_logps(outputs, batch["targets"], entropy_grad=bool(self.entropy_coef))
        per_token, coef_1, kl, extra = self.per_token(logps, batch, loss_mask)
        scoring = mask  # the tokens the policy term acts on
        if self.top_entropy_quantile < 1.0:  # TRL's get_high_entropy_mask: the batch's top tokens by entropy
            threshold = jnp.nanquantile(jnp.where(mask > 0, entropy, jnp.nan), 1.0 - self.top_entropy_quantile)
            high_entropy = (entropy * mask >= threshold).astype(jnp.float32)
            per_token, scoring = per_token * high_entropy, mask * high_entropy
        if kl is not None:
            per_token = per_token + self.beta * kl
        masked = per_token * mask
        if self.loss in ("grpo", "sapo"):
            loss = jnp.sum(jnp.sum(masked, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0) * w)
        elif self.loss == "dr_grpo":
            loss = jnp.sum(masked) / self.max_completion_length
        elif self.loss == "luspo":
            loss = jnp.sum(masked)
        else:  # bnpo, dapo, cispo, vespo: over the step's completion tokens
            loss = jnp.sum(masked) * totals["rows"] / totals["tokens"]
        out = {"loss": loss, "weight": jnp.sum(w), "completion_tokens": jnp.sum(mask),
               "entropy": jnp.sum(entropy * mask)}
        if self.entropy_coef:  # TRL's bonus: the micro-batch's mean entropy over the scoring tokens
            bonus = jnp.sum(entropy * scoring) / jnp.maximum(jnp.sum(scoring), 1.0)
            out["policy_loss"] = loss
            out["loss"] = loss - self.entropy_coef * bonus * jnp.sum(w)
        rows = coef_1.shape[-1] == 1  # the sequence level: one weight per completion, metrics over rows

        def total(x):
            return jnp.sum(x * w[:, None]) if rows else jnp.sum(x * mask)

        advantages = batch["advantages"].astype(jnp.float32)[:, None]
        if self.loss in CLIPPED:
            low = ((coef_1 < 1.0 - self.epsilon) & (advantages < 0)).astype(jnp.float32)
            high = ((coef_1 > 1.0 + self.epsilon_high) & (advantages > 0)).astype(jnp.float32)
            out.update({"clip_ratio/low_mean": total(low), "clip_ratio/high_mean": total(high),
                        "clip_ratio/region_mean": total(jnp.maximum(low, high))})
            # TRL's low_min / high_max: over the completions, of each one's clipped share (its
            # masked mean; at the sequence level its one value), completions without tokens left out
            count = jnp.sum(mask, -1)
            real = w > 0 if rows else count > 0

            def per_row(x):
                return x[:, 0] if rows else jnp.sum(x * mask, -1) / jnp.maximum(count, 1.0)

            out.update(extremes(per_row(low), per_row(high), real))
        elif self.loss == "cispo":
            out["cispo_clip_ratio"] = total(((coef_1 > self.epsilon_high) & (advantages > 0)).astype(jnp.float32))
        elif self.loss == "vespo":
            out["vespo/phi_seq_mean"] = jnp.sum(extra["phi_seq"] * w[:, None])
        if kl is not None:
            out["kl"] = jnp.sum(kl * mask)
        return out

    def rloo_sums(self, outputs, batch) -> dict:
        """RLOO's loss as TRL's ``RLOOTrainer._compute_loss``: the sequence's ratio of summed
        log-probs, clipped as PPO's, the mean over completions; clip ratios over completions."""
        w = batch["weights"].astype(jnp.float32)
        mask = batch["loss_mask"].astype(jnp.float32)
        logps, entropy = token_logps(outputs, batch["targets"])
        seq, old = jnp.sum(logps * mask, -1), jnp.sum(self.old_logps(logps, batch) * mask, -1)  # [rows]
        coef_1 = jnp.exp(seq - old)
        coef_2 = jnp.clip(coef_1, 1.0 - self.epsilon, 1.0 + self.epsilon_high)
        advantages = batch["advantages"].astype(jnp.float32)
        loss = -jnp.minimum(coef_1 * advantages, coef_2 * advantages)
        low = ((coef_1 < 1.0 - self.epsilon) & (advantages < 0)).astype(jnp.float32)
        high = ((coef_1 > 1.0 + self.epsilon_high) & (advantages > 0)).astype(jnp.float32)
        tokens = mask * w[:, None]
        return {"loss": jnp.sum(loss * w), "weight": jnp.sum(w), "completion_tokens": jnp.sum(tokens),
                "entropy": jnp.sum(entropy * tokens), "clip_ratio/low_mean": jnp.sum(low * w),
                "clip_ratio/high_mean": jnp.sum(high * w), "clip_ratio/region_mean": jnp.sum(jnp.maximum(low, high) * w),
                **extremes(low, high, w > 0)}

    def extra_metrics(self, sums, total_weight) -> dict:
        """TRL's ``global_masked_mean``: means over the step's completion tokens, or over its
        completions for the per-completion values (the sequence level, RLOO's ratios, vespo's phi)."""
        tokens = jnp.maximum(sums["completion_tokens"], 1.0)
        per_row = self.name == "rloo" or self.importance_sampling_level == "sequence"
        out = {k: sums[k] / tokens for k in ("kl", "entropy") if k in sums}
        for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio"):
            if k in sums:
                out[k] = sums[k] / (total_weight if per_row else tokens)
        if "min_clip_low" in sums:  # NaN when no completion had tokens, as TRL's nanmin
            finite = lambda x: jnp.where(jnp.isfinite(x), x, jnp.nan)  # noqa: E731
            out.update({"clip_ratio/low_min": finite(sums["min_clip_low"]),
                        "clip_ratio/high_max": finite(sums["max_clip_high"])})
        if "vespo/phi_seq_mean" in sums:
            out["vespo/phi_seq_mean"] = sums["vespo/phi_seq_mean"] / total_weight
        if "policy_loss" in sums:
            out.update({"policy_loss": sums["policy_loss"] / total_weight,
                        "entropy_coef": jnp.asarray(self.entropy_coef, jnp.float32)})
        return out

    def reference_logps(self, outputs, batch):
        """Per-token log-probs ``[rows, length]`` (the reference's, or the old policy's)."""
        return token_logps(outputs, batch["targets"])[0]


def extremes(low, high, real) -> dict:
    """The step's ``min_clip_low`` / ``max_clip_high`` sums (``min_`` / ``max_``: reduced over
    microbatches by their min / max): of the completions' clipped shares ``[rows]``, real ones only."""
    return {"min_clip_low": jnp.min(jnp.where(real, low, jnp.inf)),
            "max_clip_high": jnp.max(jnp.where(real, high, -jnp.inf))}


def grpo_task(loss: str | None = None, beta: float | None = None, epsilon: float = 0.2,
              epsilon_high: float | None = None, num_iterations: int = 1, max_completion_length: int = 64,
              name: str = "grpo", **options) -> GRPOTask:
    """The ``grpo`` task (``name="rloo"``: RLOO's, its loss TRL's RLOOTrainer's); ``options``:
    the other GRPOTask fields (TRL's names). Bad settings are one-line UserErrors."""
    if name == "rloo":
        if loss is not None:
            raise UserError(f"--loss {loss!r}: --task rloo has one loss (TRL's RLOOTrainer has no loss_type)")
        loss = "rloo"
    else:
        loss = loss or "dapo"
        if loss not in LOSSES:
            raise UserError(f"--loss {loss!r}: --task grpo takes one of {', '.join(LOSSES)}")
    level = options.get("importance_sampling_level", "token")
    if level not in LEVELS:
        raise UserError(f"--importance-sampling-level {level!r}: choose token or sequence")
    beta = (0.05 if name == "rloo" else 0.0) if beta is None else float(beta)
    if not (math.isfinite(beta) and beta >= 0):
        raise UserError(f"--beta must be a finite number >= 0, got {beta}")
    quantile = options.get("top_entropy_quantile", 1.0)
    if not 0.0 <= quantile <= 1.0:
        raise UserError(f"--top-entropy-quantile must be in [0, 1], got {quantile}")
    high = epsilon if epsilon_high is None else epsilon_high
    return GRPOTask(name, "completions", "policy_loss", has_accuracy=False, has_perplexity=False,
                    signals=("reward", "rewards/*/mean"), loss=loss,
                    beta=beta, epsilon=float(epsilon), epsilon_high=float(high), num_iterations=int(num_iterations),
                    max_completion_length=int(max_completion_length), **options)
