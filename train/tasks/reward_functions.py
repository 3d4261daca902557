"""GRPO's and RLOO's host side: the user's reward functions (``FILE.py:NAME``, TRL's signature)
and the scores they give, the group advantages and RLOO's leave-one-out rewards, and the rows a
rollout's sampled completions become."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import numpy as np

from shardzoo.errors import UserError


class RewardError(UserError):
    """A reward function raised, or returned the wrong count or a value that is not a finite number."""


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """A user's reward function and where it came from (``FILE.py:NAME``)."""

    name: str
    fn: object
    spec: str


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


def rloo_rewards(per_function: np.ndarray, weights, group: int, kl: np.ndarray | None = None, beta: float = 0.0,
                 normalize: bool = False, clip=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rewards, advantages, std)`` as TRL's ``RLOOTrainer``: the weighted sum of the functions'
    rewards (NaN where none scored), clipped to ``clip`` (MIN, MAX), less ``beta`` times each
    completion's summed KL ``kl``, minus the mean of its group's other scored completions
    (leave-one-out); with ``normalize`` the batch's advantages to mean 0, std 1 (+ 1e-4). An
    unscored completion, or one alone in its group, gets advantage 0. ``rewards`` (what the metrics
    report) is the weighted sum; ``std`` the group's spread of the penalised rewards."""
    logged = weighted_sum(per_function, weights)
    r = logged if clip is None else np.clip(logged, clip[0], clip[1])
    if beta:
        r = r - np.float32(beta) * np.asarray(kl, np.float32)
    grouped = r.reshape(-1, group).astype(np.float32)
    counts = (~np.isnan(grouped)).sum(1, keepdims=True).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        baselines = (np.nansum(grouped, 1, keepdims=True, dtype=np.float32) - grouped) / (counts - 1)
    adv = (grouped - baselines).ravel()
    if normalize:
        mean, std = nan_mean_std(adv, 0)
        adv = (adv - mean) / (std + np.float32(1e-4))
    std = np.repeat(nan_mean_std(grouped, 1)[1][:, 0], group)
    return logged, np.nan_to_num(adv, nan=0.0).astype(np.float32), std


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
