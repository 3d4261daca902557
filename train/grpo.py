"""GRPO as a task: completions sampled on the training mesh, scored by reward functions, and the
clipped-ratio loss of TRL's ``GRPOTrainer`` (its names, its formulas).

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

The loss (TRL's ``_compute_loss``, token-level importance sampling), per completion token ``t``
with ``p_t`` the policy's log-prob, ``o_t`` the old policy's (``stop_gradient(p_t)`` with one
iteration: the ratio is exactly 1), ``q_t`` the reference's::

    ratio = exp(p_t - o_t);  l_t = -min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A)
    l_t += beta (exp(q_t - p_t) - (q_t - p_t) - 1)            # k3 estimator of KL, beta > 0

aggregated by ``loss`` (TRL's ``loss_type``): ``grpo`` the mean over completions of each one's
mean over its tokens; ``bnpo`` the mean over the batch's completion tokens; ``dr_grpo`` the sum
over tokens divided by ``completions * max_completion_length``.

Metrics (TRL's names): ``reward``, ``reward_std``, ``rewards/<function>/mean`` and ``/std``,
``frac_reward_zero_std``, ``completions/mean_length`` (``min``, ``max``, ``clipped_ratio``),
``kl``, ``entropy``, ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``;
and ``time/sampling_s``, ``time/scoring_s`` of the step's rollout.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from shardzoo.errors import UserError
from shardzoo.models.tiled_loss import token_stats
from shardzoo.sharding import axes as ax
from shardzoo.train.tasks import Field, Task

LOSSES = ("grpo", "bnpo", "dr_grpo")
SEQ_KEYS = ("inputs", "targets", "positions", "segment_ids")


class RewardError(UserError):
    """A reward function raised, or returned the wrong count or a value that is not a finite number."""


def token_logps(outputs, targets):
    """``(each target's log-probability, the softmax's entropy)``, each ``[rows, length]``, from
    logits ``[rows, length, vocab]`` (or ``HeadInputs``: tiled, ``models/tiled_loss.py``)."""
    stats = token_stats(outputs, targets)
    return stats.logp, stats.entropy


@dataclasses.dataclass(frozen=True)
class GRPOTask(Task):
    """The GRPO loss on a rollout batch (see the module docstring)."""

    loss: str = "grpo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    num_iterations: int = 1
    max_completion_length: int = 64

    @property
    def tiles_head(self) -> bool:
        return True  # the loss reads the targets' log-probabilities; the entropy (a metric) tiles too

    @property
    def reference_keys(self) -> tuple[str, ...]:
        return ("ref_logps",) if self.beta else ()

    @property
    def later_keys(self) -> tuple[str, ...]:
        """Batch entries computed on the device after the rollout: old and reference log-probs."""
        return (("old_logps",) if self.num_iterations > 1 else ()) + self.reference_keys

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
        """The step's completions and completion tokens (bnpo and dr_grpo divide by them)."""
        w = batch["weights"].astype(jnp.float32)
        tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32) * w[:, None])
        return {"rows": jnp.maximum(jnp.sum(w), 1e-8), "tokens": jnp.maximum(tokens, 1.0)}

    def per_token(self, logps, batch):
        """``(per-token loss, ratio, kl or None)``, each ``[rows, length]``."""
        old = batch["old_logps"] if self.num_iterations > 1 else jax.lax.stop_gradient(logps)
        ratio = jnp.exp(logps - old)
        clipped = jnp.clip(ratio, 1.0 - self.epsilon, 1.0 + self.epsilon_high)
        advantages = batch["advantages"].astype(jnp.float32)[:, None]
        loss = -jnp.minimum(ratio * advantages, clipped * advantages)
        kl = None
        if self.beta:
            delta = batch["ref_logps"] - logps
            kl = jnp.exp(delta) - delta - 1.0
            loss = loss + self.beta * kl
        return loss, ratio, kl

    def sums(self, outputs, batch, totals=None) -> dict:
        """Sums over the rows; ``sums["loss"] / sum(weights)`` is the step's loss (see the module
        docstring: bnpo and dr_grpo scale by the step's totals)."""
        totals = self.step_totals(batch) if totals is None else totals
        w = batch["weights"].astype(jnp.float32)
        mask = batch["loss_mask"].astype(jnp.float32) * w[:, None]  # [rows, length]
        logps, entropy = token_logps(outputs, batch["targets"])
        per_token, ratio, kl = self.per_token(logps, batch)
        masked = per_token * mask
        if self.loss == "grpo":
            loss = jnp.sum(jnp.sum(masked, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0) * w)
        elif self.loss == "bnpo":
            loss = jnp.sum(masked) * totals["rows"] / totals["tokens"]
        else:  # dr_grpo
            loss = jnp.sum(masked) / self.max_completion_length
        advantages = batch["advantages"].astype(jnp.float32)[:, None]
        low = ((ratio < 1.0 - self.epsilon) & (advantages < 0)).astype(jnp.float32)
        high = ((ratio > 1.0 + self.epsilon_high) & (advantages > 0)).astype(jnp.float32)
        out = {"loss": loss, "weight": jnp.sum(w), "completion_tokens": jnp.sum(mask),
               "entropy": jnp.sum(entropy * mask), "clip_ratio/low_mean": jnp.sum(low * mask),
               "clip_ratio/high_mean": jnp.sum(high * mask),
               "clip_ratio/region_mean": jnp.sum(jnp.maximum(low, high) * mask)}
        if kl is not None:
            out["kl"] = jnp.sum(kl * mask)
        return out

    def extra_metrics(self, sums, total_weight) -> dict:
        """Means over the step's completion tokens, as TRL's ``global_masked_mean``."""
        tokens = jnp.maximum(sums["completion_tokens"], 1.0)
        names = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
        return {k: sums[k] / tokens for k in names if k in sums}

    def reference_logps(self, outputs, batch):
        """Per-token log-probs ``[rows, length]`` (the reference's, or the old policy's)."""
        return token_logps(outputs, batch["targets"])[0]


def grpo_task(loss: str | None = None, beta: float | None = None, epsilon: float = 0.2,
              epsilon_high: float | None = None, num_iterations: int = 1,
              max_completion_length: int = 64) -> GRPOTask:
    """The ``grpo`` task; bad settings are one-line UserErrors."""
    loss = loss or "grpo"
    if loss not in LOSSES:
        raise UserError(f"--loss {loss!r}: --task grpo takes one of {', '.join(LOSSES)}")
    beta = 0.0 if beta is None else float(beta)
    if not (math.isfinite(beta) and beta >= 0):
        raise UserError(f"--beta must be a finite number >= 0, got {beta}")
    high = epsilon if epsilon_high is None else epsilon_high
    return GRPOTask("grpo", "completions", "policy_loss", has_accuracy=False, has_perplexity=False, loss=loss,
                    beta=beta, epsilon=float(epsilon), epsilon_high=float(high), num_iterations=int(num_iterations),
                    max_completion_length=int(max_completion_length))


# ------------------------------------------------------------------------------ rewards
@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """A user's reward function and where it came from (``FILE.py:NAME``)."""

    name: str
    fn: object
    spec: str


def rollout_layout(cfg, config):
    """The model GRPO trains: its layers unrolled unless ``--override scan_layers=...`` says
    otherwise. The rollouts decode the train state's own params, and decoding runs the layers
    unrolled (``execution.decode_layers="unroll"``, the default: ``models/decode.py``): params
    stacked by a scan would be cut into a copy of the layer weights by every rollout, unrolled
    ones are read where they are. (``decode_layers="scan"`` decodes a stack without a copy, in
    slower steps.)"""
    from shardzoo.models import parse_overrides

    execution = getattr(config, "execution", None)
    if getattr(cfg, "task", None) != "grpo" or not getattr(execution, "scan_layers", False):
        return config
    if "scan_layers" in parse_overrides(getattr(cfg, "override", None) or []):
        return config
    return config.replace(scan_layers=False)


def load_reward_function(spec: str) -> RewardFunction:
    """``FILE.py:FUNCTION`` imported; a one-line UserError naming the spec when it cannot be."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise UserError(f"--reward-funcs {spec!r}: expected FILE.py:FUNCTION")
    if not os.path.isfile(path):
        raise UserError(f"--reward-funcs {spec}: no file {path}")
    module_name = f"shardzoo_reward_{abs(hash(os.path.abspath(path)))}"
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: any failure is one line naming it
        raise UserError(f"--reward-funcs {spec}: importing {path} raised {type(e).__name__}: {e}".splitlines()[0]) \
            from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"--reward-funcs {spec}: {path} defines no function {name!r}")
    return RewardFunction(name, fn, spec)


def score(functions, prompts, completions, completion_ids, columns) -> np.ndarray:
    """``[completions, functions]`` float32 rewards, each function called as TRL calls it:
    ``fn(prompts=..., completions=..., completion_ids=..., **columns)``. ``None`` (TRL: the function
    does not apply to that completion) is NaN here, left out of the sums and means as TRL leaves it.
    A function that raises or returns anything but one finite number or None per completion is a
    one-line ``RewardError``; so is a rollout none of whose completions any function scored."""
    n = len(completions)
    out = np.zeros((n, len(functions)), np.float32)
    for j, f in enumerate(functions):
        where = f"reward function {f.name} ({f.spec})"
        try:
            values = f.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:  # noqa: BLE001 - the user's function: any failure stops the run, one line
            raise RewardError(f"{where} raised {type(e).__name__}: {e}".splitlines()[0]) from None
        try:
            count = len(values)
        except TypeError:
            raise RewardError(f"{where} returned a {type(values).__name__}, not a list of {n} floats") from None
        if count != n:
            raise RewardError(f"{where} returned {count} rewards for {n} completions (one per completion)")
        for i, v in enumerate(values):
            if v is None:
                out[i, j] = np.nan
                continue
            try:
                x = float(v)
            except (TypeError, ValueError):
                raise RewardError(f"{where} returned {v!r} for completion {i}, not a number") from None
            if not math.isfinite(x):
                raise RewardError(f"{where} returned {x} for completion {i}: rewards must be finite numbers")
            out[i, j] = x
    if n and np.isnan(out).all(1).all():
        names = ", ".join(f.name for f in functions)
        raise RewardError(f"reward functions {names} returned None for all {n} completions: none was scored")
    return out


def nan_mean_std(x: np.ndarray, axis) -> tuple[np.ndarray, np.ndarray]:
    """The mean and the unbiased std over ``axis`` of ``x``'s non-NaN values (kept dims), as TRL's
    ``nanmean`` and ``nanstd``: NaN where no value (mean) or fewer than two (std) are left."""
    x = np.asarray(x, np.float32)
    valid = ~np.isnan(x)
    count = valid.sum(axis, keepdims=True).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(valid, x, 0).sum(axis, keepdims=True, dtype=np.float32) / count
        var = np.where(valid, (x - mean) ** 2, 0).sum(axis, keepdims=True, dtype=np.float32) / (count - 1)
        std = np.where(count > 1, np.sqrt(var), np.nan)
    return mean.astype(np.float32), std.astype(np.float32)


def advantages(rewards: np.ndarray, group: int, scale: str) -> tuple[np.ndarray, np.ndarray]:
    """``(advantages, std)`` of summed rewards ``[completions]`` (groups of ``group`` in a row):
    ``r - mean_group(r)``, divided by ``std + 1e-4`` (unbiased std of the group, or of the batch)
    unless ``scale="none"``, as TRL's GRPOTrainer (float32). A NaN reward (no function scored the
    completion) is left out of the means and stds and gets advantage 0."""
    r = np.asarray(rewards, np.float32)
    mean, std = nan_mean_std(r.reshape(-1, group), 1)
    mean = np.repeat(mean[:, 0], group)
    std = np.full_like(r, nan_mean_std(r, 0)[1][0]) if scale == "batch" else np.repeat(std[:, 0], group)
    centred = r - mean
    out = centred if scale == "none" else centred / (std + np.float32(1e-4))
    return np.nan_to_num(out, nan=0.0).astype(np.float32), std


def weighted_sum(per_function: np.ndarray, weights, unscored: np.ndarray | None = None) -> np.ndarray:
    """The weighted sums ``[completions]`` of ``[completions, functions]`` rewards, the NaNs (a
    function that does not apply) left out, NaN where no function scored (or ``unscored``)."""
    per_function = np.asarray(per_function, np.float32)
    out = np.nansum(per_function * np.asarray(weights, np.float32)[None, :], 1).astype(np.float32)
    out[np.isnan(per_function).all(1) if unscored is None else unscored] = np.nan
    return out


def group_rewards(per_function: np.ndarray, weights: np.ndarray, group: int, scale: str,
                  aggregation: str = "sum_then_normalize") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rewards, advantages, std)`` of a rollout's ``[completions, functions]`` rewards (NaN: not
    scored), as TRL's ``multi_objective_aggregation``: ``sum_then_normalize`` the weighted sum of
    the functions' rewards normalised in its group (``advantages``); ``normalize_then_sum`` each
    function's rewards normalised in its group first, their weighted sum then normalised over the
    batch. ``rewards`` (the weighted sum, NaN where nothing scored) is what the metrics report;
    ``std`` the spread whose zeros ``frac_reward_zero_std`` counts."""
    per_function = np.asarray(per_function, np.float32)
    weights = np.asarray(weights, np.float32)
    unscored = np.isnan(per_function).all(1)
    rewards = weighted_sum(per_function, weights)
    if aggregation == "sum_then_normalize":
        adv, std = advantages(rewards, group, scale)
        return rewards, adv, std
    grouped = per_function.reshape(-1, group, per_function.shape[1])
    mean_k, std_k = nan_mean_std(grouped, 1)
    normalised = ((grouped - mean_k) / (std_k + np.float32(1e-4))).reshape(per_function.shape)
    summed = weighted_sum(normalised, weights, unscored)
    mean, std = nan_mean_std(summed, 0)
    adv = np.nan_to_num((summed - mean) / (std + np.float32(1e-4)), nan=0.0).astype(np.float32)
    return rewards, adv, np.full_like(summed, std[0])


def truncated(completions: np.ndarray, lengths: np.ndarray, ended: np.ndarray, pad_id: int) -> np.ndarray:
    """Which completions TRL's ``mask_truncated_completions`` masks: those whose last token is
    neither an eos nor the pad token (they ran out of room)."""
    last = completions[np.arange(len(lengths)), np.maximum(lengths, 1) - 1]
    return ~ended & (last != pad_id)


# ------------------------------------------------------------------------------ rollout rows
def left_pad(prompts, width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [rows, width], lengths [rows])``: each prompt right-aligned (decoding's layout)."""
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    lengths = np.zeros(len(prompts), np.int32)
    for i, p in enumerate(prompts):
        p = np.asarray(p, np.int32)[-width:]
        tokens[i, width - len(p):] = p
        lengths[i] = len(p)
    return tokens, lengths


def completion_lengths(completions: np.ndarray, eos_ids) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, ended)`` per row: tokens up to and including the first eos, and whether one came."""
    is_eos = np.isin(completions, np.asarray(list(eos_ids) or [-1]))
    ended = is_eos.any(1)
    lengths = np.where(ended, is_eos.argmax(1) + 1, completions.shape[1])
    return lengths.astype(np.int32), ended


def rollout_rows(tokens: np.ndarray, prompt_lengths: np.ndarray, lengths: np.ndarray, prompt_width: int,
                 pad_id: int) -> dict:
    """The batch's sequence entries of sampled rows ``tokens [rows, prompt_width + completion]``
    (prompt right-aligned in the first ``prompt_width`` slots, ``lengths`` completion tokens
    after it): positions from 0 at each prompt's first token, segment 1 on the real tokens, a
    target that scores where it is a completion token."""
    rows, width = tokens.shape
    cols = np.arange(width)[None, :]
    start = (prompt_width - prompt_lengths)[:, None]
    valid = (cols >= start) & (cols < prompt_width + lengths[:, None])
    inputs = np.where(valid, tokens, pad_id)
    targets = np.full_like(inputs, pad_id)
    targets[:, :-1] = np.where(valid[:, 1:], inputs[:, 1:], pad_id)
    loss_mask = np.zeros((rows, width), np.float32)
    loss_mask[:, :-1] = valid[:, 1:] & (cols[:, 1:] >= prompt_width)
    return {"inputs": inputs.astype(np.int32), "targets": targets.astype(np.int32),
            "positions": np.where(valid, cols - start, 0).astype(np.int32),
            "segment_ids": valid.astype(np.int32), "loss_mask": loss_mask}
