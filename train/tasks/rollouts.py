"""GRPO's loop: the rollout data (prompts, the sampler's key, the rollout being trained on) and
the Trainer that samples, scores and steps (``grpo.py`` holds the loss, ``reward_functions.py`` the rewards and advantages).

``Rollouts`` is the run's train data: ``next`` gives the prompt indices of a new rollout when
one is due (every ``num_iterations`` steps), else None (the step reuses the current rollout).
Its ``state()`` (saved with every checkpoint, like any data iterator's) holds the prompt
iterator's position, the sampler's key and, when a checkpoint falls inside a rollout's
iterations, that rollout's batch: a resumed run samples and trains on exactly what the
uninterrupted run would have.

Held-out prompts (``--eval-data``, or ``--eval-fraction`` of the prompts, a seeded choice) are
evaluated every ``--eval-every`` steps and at the end as ``shardzoo eval --task rewards`` scores a
run: completions sampled as the rollouts are (the same compiled sampler, a fixed key of their own),
TRL's reward metrics named ``eval_*`` (``eval_reward``, ``eval_rewards/<function>/mean``, ...).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from shardzoo.data.prompts import PromptIterator, split_prompts, tokenize_prompts
from shardzoo.errors import UserError
from shardzoo.train.jit import host_array
from shardzoo.train.metrics import progress
from shardzoo.train.tasks.component import RunTask, language_model_only
from shardzoo.train.tasks.grpo import grpo_task
from shardzoo.train.tasks.preference import reference_kind
from shardzoo.train.tasks.reward import RewardModel, reward_model_program
from shardzoo.train.tasks.reward_functions import (
    RewardFunction,
    completion_lengths,
    group_rewards,
    left_pad,
    load_reward_function,
    nan_mean_std,
    rloo_rewards,
    rollout_rows,
    score,
    truncated,
    weighted_sum,
)
from shardzoo.train.tasks.settings import GRPO_OPTIONS
from shardzoo.train.trainer import Trainer, is_main_process

SAMPLER_STREAM = 0x5EED  # the sampler's key: fold_in(key(seed), SAMPLER_STREAM)
EVAL_STREAM = 0xE7A1  # the held-out prompts' completions: fold_in(key(seed), EVAL_STREAM), then the call
FLOAT_KEYS = ("loss_mask", "advantages", "weights", "old_logps", "ref_logps")


def completion_length(cfg) -> int:
    """Tokens sampled per completion: ``--max-completion-length``, default half ``--seq-len``."""
    return cfg.max_completion_length or cfg.seq_len // 2



def train_prompts(cfg, tokenizer):
    """``(prompts, prompt width, completion length)`` of a sampling run's ``--data``: the prompt
    width is ``--seq-len`` less ``--max-completion-length``, which ``--max-prompt-length`` must fit."""
    from shardzoo.data import load_source

    completion = completion_length(cfg)
    width = cfg.seq_len - completion
    if cfg.max_prompt_length is not None and not 1 <= cfg.max_prompt_length <= width:
        raise UserError(f"--max-prompt-length {cfg.max_prompt_length} must be from 1 to --seq-len - "
                        f"--max-completion-length = {width}")
    prompts = tokenize_prompts(load_source(cfg.data), tokenizer, cfg.data,
                               max_prompt_length=cfg.max_prompt_length or width, add_bos=cfg.add_bos,
                               skip_bad=cfg.skip_missing)
    return prompts, width, completion

def rollout_layout(cfg, config):
    """The model GRPO trains: its layers unrolled unless ``--override scan_layers=...`` says
    otherwise. The rollouts decode the train state's own params, and decoding runs the layers
    unrolled (``execution.decode_layers="unroll"``, the default: ``models/decode.py``): params
    stacked by a scan would be cut into a copy of the layer weights by every rollout, unrolled
    ones are read where they are. (``decode_layers="scan"`` decodes a stack without a copy, in
    slower steps.)"""
    from shardzoo.models import parse_overrides

    execution = getattr(config, "execution", None)
    if not getattr(execution, "scan_layers", False):
        return config
    if "scan_layers" in parse_overrides(getattr(cfg, "override", None) or []):
        return config
    return config.replace(scan_layers=False)


class Rollouts:
    """A GRPO run's train data (see the module docstring)."""

    def __init__(self, prompts, tokenizer, functions, weights, *, group: int, iterations: int, scale: str,
                 prompt_width: int, completion: int, sampling: dict, batch_size: int, seed: int,
                 aggregation: str = "sum_then_normalize", mask_truncated: bool = False, eval_prompts=None,
                 normalize_advantages: bool = False, reward_clip_range=None):
        self.prompts, self.tokenizer, self.functions = prompts, tokenizer, functions
        self.weights = np.asarray(weights, np.float32)
        self.group, self.iterations, self.scale = group, iterations, scale
        self.aggregation, self.mask_truncated = aggregation, mask_truncated
        self.normalize_advantages, self.reward_clip_range = normalize_advantages, reward_clip_range  # RLOO's
        self.eval_prompts = eval_prompts  # a PromptSet of held-out prompts, or None
        self.prompt_width, self.completion, self.sampling = prompt_width, completion, sampling
        self.iterator = PromptIterator(len(prompts), batch_size // group, seed)
        self.sampler_key = sampler_key(seed)
        self.current = None  # (host batch, metrics) of the rollout being trained on
        self.used = 0  # steps taken on it

    def __iter__(self):
        return self

    def __next__(self):
        """The prompt indices of a new rollout, or None while the current one is reused."""
        if self.current is None or self.used >= self.iterations:
            return next(self.iterator)
        return None

    def state(self) -> dict:
        state = {"prompts": self.iterator.state(), "sampler_key": self.sampler_key.tolist(), "used": self.used}
        if self.current is not None and self.used < self.iterations:
            batch, metrics = self.current
            state["rollout"] = {"batch": {k: v.tolist() for k, v in batch.items()}, "metrics": metrics}
        return state

    def restore(self, state: dict) -> None:
        self.iterator.restore(state["prompts"])
        self.sampler_key = np.asarray(state["sampler_key"], np.uint32)
        self.used, self.current = int(state["used"]), None
        if state.get("rollout"):
            batch = {k: np.asarray(v, np.float32 if k in FLOAT_KEYS else np.int32)
                     for k, v in state["rollout"]["batch"].items()}
            self.current = (batch, dict(state["rollout"]["metrics"]))

    def key(self, step: int) -> np.ndarray:
        """The sampler's key of the rollout taken before step ``step + 1``."""
        key = jax.random.fold_in(jax.random.wrap_key_data(self.sampler_key), step)
        return np.asarray(jax.random.key_data(key), np.uint32)

    def sample(self, program, params, prompts, indices, key) -> Sampled:
        """``sample_and_score`` of ``prompts`` at ``indices`` with this run's settings, a step's
        prompts per call (the rollouts' shape: one compiled sampler for both)."""
        return sample_and_score(program, params, prompts, indices, self.iterator.count, key=key,
                                tokenizer=self.tokenizer, functions=self.functions, group=self.group,
                                width=self.prompt_width, completion=self.completion, sampling=self.sampling)

    def eval_key(self, call: int) -> np.ndarray:
        return held_out_key(self.sampler_key, call)


def sampler_key(seed: int) -> np.ndarray:
    """A run's sampler key (raw uint32 [2]) from its seed."""
    return np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), SAMPLER_STREAM)), np.uint32)


def held_out_key(key: np.ndarray, call: int) -> np.ndarray:
    """The key of the held-out prompts' ``call``-th sampling call under the sampler key ``key``:
    the same at every evaluation of a run, and in ``shardzoo eval --split eval`` of it."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(key), EVAL_STREAM), call)
    return np.asarray(jax.random.key_data(key), np.uint32)


@dataclasses.dataclass(frozen=True)
class Sampled:
    """What ``sample_and_score`` gives: ``tokens`` [rows, width + completion] (prompt right-aligned
    in the first ``width`` slots), ``prompt_lengths``, completion ``lengths`` (to the first eos,
    kept), ``ended`` (an eos came) and ``rewards`` [rows, functions] (NaN: None, not applicable)."""

    tokens: np.ndarray
    prompt_lengths: np.ndarray
    lengths: np.ndarray
    ended: np.ndarray
    rewards: np.ndarray
    sampling_s: float  # the sampler's wall time (the rest is decoding the texts and the reward functions)


def sample_and_score(program, params, prompts, indices, per_call: int, *, key, tokenizer, functions, group: int,
                     width: int, completion: int, sampling: dict) -> Sampled:
    """``group`` completions for each prompt of ``prompts`` (a ``PromptSet``) at ``indices``,
    sampled by ``program.generate`` on ``params`` (``per_call`` prompts a call: fewer are padded
    with the first, so every call has one shape and the sampler compiles once) and scored by the
    reward functions as TRL calls them (``reward_functions.score``: texts, or one assistant message each
    for conversational prompts; the prompts and the other columns as the data holds them)."""
    indices = [int(i) for i in indices]
    rows = len(indices) * group
    padded = indices + [indices[0]] * (per_call - len(indices))
    prompt, prompt_lengths = left_pad([prompts.ids[i] for i in padded for _ in range(group)], width, tokenizer.pad_id)
    start = time.perf_counter()
    tokens = program.decoding.generate(params, prompt, prompt_lengths, max_new_tokens=completion, key=key,
                              eos_ids=(tokenizer.eos_id,), pad_id=tokenizer.pad_id, **sampling)[:rows]
    seconds = time.perf_counter() - start
    lengths, ended = completion_lengths(tokens[:, width:], (tokenizer.eos_id,))
    ids = [row[:n].tolist() for row, n in zip(tokens[:, width:], lengths, strict=True)]
    texts = [tokenizer.decode(i) for i in ids]
    if prompts.conversational:
        texts = [[{"role": "assistant", "content": t}] for t in texts]
    picked = [i for i in indices for _ in range(group)]
    columns = {k: [v[i] for i in picked] for k, v in prompts.columns.items()}
    rewards = score(functions, [prompts.prompts[i] for i in picked], texts, ids, columns)
    if jax.process_count() > 1:  # every process scored every completion: all train on process 0's rewards
        from jax.experimental import multihost_utils

        rewards = np.asarray(multihost_utils.broadcast_one_to_all(rewards), np.float32)
    return Sampled(tokens, prompt_lengths[:rows], lengths, ended, rewards, seconds)


def reward_metrics(rewards: np.ndarray, weights, functions, lengths: np.ndarray, ended: np.ndarray,
                   prefix: str = "", suffix: str = "") -> dict:
    """TRL's reward and completion metrics of ``rewards`` [completions, functions] (NaN: not
    scored): ``reward`` (the weighted sums' mean, completions no function scored left out) and
    ``reward_std``, ``rewards/<function>/mean`` and ``/std``, ``completions/mean_length``, ``min``,
    ``max`` and ``clipped_ratio``; each name as ``prefix + name + suffix``."""
    mean, std = nan_mean_std(weighted_sum(rewards, weights), 0)
    out = {"reward": float(mean[0]), "reward_std": float(std[0])}
    for j, f in enumerate(functions):
        mean, std = nan_mean_std(rewards[:, j], 0)
        out[f"rewards/{f.name}/mean"], out[f"rewards/{f.name}/std"] = float(mean[0]), float(std[0])
    out.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float((~ended).mean())})
    return {f"{prefix}{k}{suffix}": v for k, v in out.items()}


def rollout_data(cfg, tokenizer, program=None) -> Rollouts:
    """The ``Rollouts`` of a run's settings: its prompts read and tokenized, its reward functions
    imported and its ``--reward-model`` loaded (``program.reward_model``'s params), a one-line
    UserError for a bad file, column, function or model before anything runs."""
    from shardzoo.data import load_source

    if not cfg.reward_funcs and not getattr(cfg, "reward_model", None):
        raise UserError(f"--task {cfg.task} needs --reward-funcs FILE.py:FUNCTION[,FILE.py:FUNCTION...] "
                        "or --reward-model DIR")
    functions = [load_reward_function(spec) for spec in cfg.reward_funcs]
    if getattr(cfg, "reward_model", None):
        functions.append(reward_model_function(cfg.reward_model, program.reward_model, tokenizer))
    prompts, width, completion = train_prompts(cfg, tokenizer)
    eval_prompts = None
    if cfg.eval_data:
        eval_prompts = tokenize_prompts(load_source(cfg.eval_data), tokenizer, cfg.eval_data,
                                        max_prompt_length=cfg.max_prompt_length or width, add_bos=cfg.add_bos,
                                        skip_bad=cfg.skip_missing)
    elif cfg.eval_fraction:
        prompts, eval_prompts = split_prompts(prompts, cfg.eval_fraction, cfg.seed)
    try_reward_functions(functions, prompts)
    weights = cfg.reward_weights if cfg.reward_weights is not None else (1.0,) * len(functions)
    sampling = {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
    return Rollouts(prompts, tokenizer, functions, weights, group=cfg.num_generations, iterations=cfg.num_iterations,
                    scale=cfg.scale_rewards, prompt_width=width, completion=completion, sampling=sampling,
                    batch_size=cfg.batch_size, seed=cfg.seed, aggregation=cfg.multi_objective_aggregation,
                    mask_truncated=cfg.mask_truncated_completions, eval_prompts=eval_prompts,
                    normalize_advantages=cfg.normalize_advantages, reward_clip_range=cfg.reward_clip_range)


def reward_model_function(spec: str, program, tokenizer) -> RewardFunction:
    """``--reward-model`` as a reward function (``train/tasks/reward.py``'s ``RewardModel``), with its
    own tokenizer (the run's when it names none)."""
    from shardzoo.data import load_tokenizer
    from shardzoo.train.io.sources import open_source

    own = open_source(spec, what="--reward-model").tokenizer
    model = RewardModel(spec, program, load_tokenizer(own) if own else tokenizer)
    return RewardFunction(model.name, model, spec)


def try_reward_functions(functions, prompts) -> None:
    """Call each reward function once, as a rollout calls it, on the first prompt (its columns)
    with an empty completion, before anything compiles or is written. A ``TypeError`` (the
    signature: TRL passes ``prompts, completions, completion_ids`` and every column as keywords)
    or a ``KeyError`` (a column the data lacks) does not depend on the completion, so it is a
    one-line UserError here; any other failure may be the placeholder's, and is left to the
    first rollout (which stops the run with one line)."""
    if not len(prompts.prompts):
        return
    completion = [{"role": "assistant", "content": ""}] if prompts.conversational else ""
    columns = {k: v[:1] for k, v in prompts.columns.items()}
    for f in functions:
        if isinstance(f.fn, RewardModel):  # a model takes any text
            continue
        try:
            f.fn(prompts=prompts.prompts[:1], completions=[completion], completion_ids=[[]], **columns)
        except (TypeError, KeyError) as e:
            raise UserError(f"reward function {f.name} ({f.spec}) raised {type(e).__name__}: {e} when called "
                            f"once before training (columns {', '.join(sorted(columns)) or 'none'})".splitlines()[0]) \
                from None
        except Exception:  # noqa: BLE001 - maybe the empty placeholder's fault: the rollouts will tell
            pass


class GRPOTrainer(Trainer):
    """The Trainer of ``--task grpo`` and ``rloo``: a rollout every ``num_iterations`` steps, then the step."""

    def train_step(self, state, batch) -> tuple:
        data = self.train_data
        if batch is not None:  # a new rollout, sampled with the params about to be trained
            data.current, data.used = self.rollout(state.params, batch, int(jax.device_get(state.step))), 0
        data.used += 1
        host, metrics = data.current
        new_state, step_metrics = self._train_step(state, self.program.place_global(host), self.rng)
        return new_state, {**step_metrics, **metrics}

    def rollout(self, params, indices, step: int) -> tuple[dict, dict]:
        """``(host batch, metrics)`` of a new rollout for the prompts at ``indices``: GRPO's group
        advantages, or RLOO's leave-one-out ones of the rewards less the KL (``task.kl_in_reward``)."""
        data, program, tok = self.train_data, self.program, self.train_data.tokenizer
        t0 = time.perf_counter()
        got = data.sample(program, params, data.prompts, indices, data.key(step))
        lengths, ended, width = got.lengths, got.ended, data.prompt_width
        rows = len(got.tokens)
        host = {**rollout_rows(got.tokens, got.prompt_lengths, lengths, width, tok.pad_id),
                "advantages": np.zeros(rows, np.float32), "weights": np.ones(rows, np.float32)}
        if data.mask_truncated:  # TRL's mask_truncated_completions: they stay in the groups, out of the loss
            cut = truncated(got.tokens[:, width:], lengths, ended, tok.pad_id)
            host["loss_mask"] = host["loss_mask"] * (~cut)[:, None].astype(np.float32)
        task, old, extra = program.task, None, {}
        if "old_logps" in task.later_keys:  # the old policy's: these params, once per rollout
            old = host["old_logps"] = host_array(
                program.compiled_old_logps_step()(params, program.place_global(host))["old_logps"])
        if task.beta:  # the reference's: a frozen copy, or these params with the LoRA adapters off
            reference = self.reference_params if self.reference_params is not None else params
            placed = program.place_global(host)
            host["ref_logps"] = host_array(program.compiled_reference_step()(reference, placed)["ref_logps"])
        if task.kl_in_reward:  # RLOO: the first-order KL of each completion, summed, in its reward
            kl = None
            if task.beta:
                per_token = (old - host["ref_logps"]) * host["loss_mask"]
                kl = per_token.sum(1, dtype=np.float32)
                extra["kl"] = float(per_token.sum(dtype=np.float32) / max(float(host["loss_mask"].sum()), 1.0))
            rewards, advantage, std = rloo_rewards(got.rewards, data.weights, data.group, kl, task.beta,
                                                   data.normalize_advantages, data.reward_clip_range)
        else:
            rewards, advantage, std = group_rewards(got.rewards, data.weights, data.group, data.scale,
                                                    data.aggregation)
        host["advantages"] = advantage
        total = time.perf_counter() - t0
        metrics = {**reward_metrics(got.rewards, data.weights, data.functions, lengths, ended), **extra,
                   "frac_reward_zero_std": float(np.isclose(std, 0.0).mean()),
                   "time/sampling_s": got.sampling_s, "time/scoring_s": total - got.sampling_s}
        return host, metrics

    def evaluate(self, sample: bool = False) -> dict:
        """The held-out prompts' rewards (``eval_reward``, ``eval_rewards/<function>/mean``, ...):
        completions sampled from the current params as the rollouts are, with the held-out key;
        the periodic evaluations (``sample``) take the first ``--eval-steps`` calls' prompts (named
        ``*_sampled`` when that is fewer than all), the final one all of them."""
        data = self.train_data
        if data.eval_prompts is None:
            return {}
        per_call = data.iterator.count
        calls = -(-len(data.eval_prompts) // per_call)
        limit = min(calls, self.cfg.eval_steps) if sample else calls
        parts = []
        with progress(limit, "eval", is_main_process()) as bar:
            for call in range(limit):
                indices = range(call * per_call, min((call + 1) * per_call, len(data.eval_prompts)))
                parts.append(data.sample(self.program, self.state.params, data.eval_prompts, indices,
                                         data.eval_key(call)))
                bar.update()
        return reward_metrics(np.concatenate([p.rewards for p in parts]), data.weights, data.functions,
                              np.concatenate([p.lengths for p in parts]), np.concatenate([p.ended for p in parts]),
                              prefix="eval_", suffix="_sampled" if limit < calls else "")


class RolloutRun(RunTask):
    """``--task grpo`` (``rloo``): completions sampled from the run's prompts and scored while
    training (``GRPOTrainer``); the reference none with ``--beta 0``, else as DPO's."""

    eval_task = "rewards"

    def __init__(self, name: str):
        self.name = name

    def model(self, cfg, config):
        return rollout_layout(cfg, config)

    def task(self, cfg, config):
        language_model_only(cfg, config)
        options = {n: getattr(cfg, n) for n in GRPO_OPTIONS if n in self.settings.owns}  # GRPO's, not RLOO's
        task = grpo_task(cfg.loss, cfg.beta, cfg.epsilon, cfg.epsilon_high, cfg.num_iterations,
                         completion_length(cfg), name=self.name, **options)
        if not task.beta:
            if cfg.reference:
                raise UserError("--reference: --beta 0 uses no reference model (give --beta > 0 or drop --reference)")
            return task, None
        return task, reference_kind(cfg, config)

    def datasets(self, cfg, data_config, tokenizer, mesh, rules, program):
        return rollout_data(cfg, tokenizer, program), None

    def trainer(self, cfg):
        return GRPOTrainer

    def finish(self, cfg, program, strict: bool) -> None:
        if cfg.reward_model:  # a reward model scores the completions: its own params-only Program
            program.reward_model = reward_model_program(cfg.reward_model, program.rules, program.mesh,
                                                        batch_size=cfg.batch_size, seq_len=cfg.seq_len, strict=strict)

    def default(self):
        return grpo_task(name=self.name)
