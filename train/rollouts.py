"""GRPO's loop: the rollout data (prompts, the sampler's key, the rollout being trained on) and
the Trainer that samples, scores and steps (``train/grpo.py`` holds the loss and the formulas).

``Rollouts`` is the run's train data: ``next`` gives the prompt indices of a new rollout when
one is due (every ``num_iterations`` steps), else None (the step reuses the current rollout).
Its ``state()`` (saved with every checkpoint, like any data iterator's) holds the prompt
iterator's position, the sampler's key and, when a checkpoint falls inside a rollout's
iterations, that rollout's batch: a resumed run samples and trains on exactly what the
uninterrupted run would have.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from shardzoo.data.prompts import PromptIterator, tokenize_prompts
from shardzoo.errors import UserError
from shardzoo.train.grpo import (
    completion_lengths,
    group_rewards,
    left_pad,
    load_reward_function,
    nan_mean_std,
    rollout_rows,
    score,
    truncated,
)
from shardzoo.train.trainer import Trainer

SAMPLER_STREAM = 0x5EED  # the sampler's key: fold_in(key(seed), SAMPLER_STREAM)
FLOAT_KEYS = ("loss_mask", "advantages", "weights", "old_logps", "ref_logps")


def completion_length(cfg) -> int:
    """Tokens sampled per completion: ``--max-completion-length``, default half ``--seq-len``."""
    return cfg.max_completion_length or cfg.seq_len // 2


class Rollouts:
    """A GRPO run's train data (see the module docstring)."""

    def __init__(self, prompts, tokenizer, functions, weights, *, group: int, iterations: int, scale: str,
                 prompt_width: int, completion: int, sampling: dict, batch_size: int, seed: int,
                 aggregation: str = "sum_then_normalize", mask_truncated: bool = False):
        self.prompts, self.tokenizer, self.functions = prompts, tokenizer, functions
        self.weights = np.asarray(weights, np.float32)
        self.group, self.iterations, self.scale = group, iterations, scale
        self.aggregation, self.mask_truncated = aggregation, mask_truncated
        self.prompt_width, self.completion, self.sampling = prompt_width, completion, sampling
        self.iterator = PromptIterator(len(prompts), batch_size // group, seed)
        self.sampler_key = np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), SAMPLER_STREAM)),
                                      np.uint32)
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

    def columns(self, indices) -> tuple[list, dict]:
        """The prompts (as the data holds them) and the other columns, one per completion."""
        picked = [int(i) for i in indices for _ in range(self.group)]
        return ([self.prompts.prompts[i] for i in picked],
                {k: [v[i] for i in picked] for k, v in self.prompts.columns.items()})

    def completions(self, tokens: np.ndarray, lengths: np.ndarray) -> tuple[list, list]:
        """``(completions, completion_ids)`` as the reward functions get them: texts, or one
        assistant message each for conversational prompts (TRL's forms)."""
        ids = [row[:n].tolist() for row, n in zip(tokens, lengths, strict=True)]
        texts = [self.tokenizer.decode(i) for i in ids]
        if self.prompts.conversational:
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        return texts, ids


def rollout_data(cfg, tokenizer) -> Rollouts:
    """The ``Rollouts`` of a run's settings: its prompts read and tokenized, its reward functions
    imported (a one-line UserError for a bad file, column or function, before anything runs)."""
    from shardzoo.data import load_source

    if jax.process_count() > 1:
        raise UserError("--task grpo runs on one process for now (its rollouts are scored on the host)")
    if not cfg.reward_funcs:
        raise UserError("--task grpo needs --reward-funcs FILE.py:FUNCTION[,FILE.py:FUNCTION...]")
    functions = [load_reward_function(spec) for spec in cfg.reward_funcs]
    completion = completion_length(cfg)
    width = cfg.seq_len - completion
    if cfg.max_prompt_length is not None and not 1 <= cfg.max_prompt_length <= width:
        raise UserError(f"--max-prompt-length {cfg.max_prompt_length} must be from 1 to --seq-len - "
                        f"--max-completion-length = {width}")
    prompts = tokenize_prompts(load_source(cfg.data), tokenizer, cfg.data,
                               max_prompt_length=cfg.max_prompt_length or width, add_bos=cfg.add_bos,
                               skip_bad=cfg.skip_missing)
    weights = cfg.reward_weights if cfg.reward_weights is not None else (1.0,) * len(functions)
    sampling = {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
    return Rollouts(prompts, tokenizer, functions, weights, group=cfg.num_generations, iterations=cfg.num_iterations,
                    scale=cfg.scale_rewards, prompt_width=width, completion=completion, sampling=sampling,
                    batch_size=cfg.batch_size, seed=cfg.seed, aggregation=cfg.multi_objective_aggregation,
                    mask_truncated=cfg.mask_truncated_completions)


class GRPOTrainer(Trainer):
    """The Trainer of ``--task grpo``: a rollout every ``num_iterations`` steps, then the step."""

    def train_step(self, state, batch) -> tuple:
        data = self.train_data
        if batch is not None:  # a new rollout, sampled with the params about to be trained
            data.current, data.used = self.rollout(state.params, batch, int(jax.device_get(state.step))), 0
        data.used += 1
        host, metrics = data.current
        new_state, step_metrics = self._train_step(state, self.program.place(host), self.rng)
        return new_state, {**step_metrics, **metrics}

    def rollout(self, params, indices, step: int) -> tuple[dict, dict]:
        """``(host batch, metrics)`` of a new rollout for the prompts at ``indices``."""
        data, program, tok = self.train_data, self.program, self.train_data.tokenizer
        t0 = time.perf_counter()
        prompt, prompt_lengths = left_pad([data.prompts.ids[int(i)] for i in indices for _ in range(data.group)],
                                          data.prompt_width, tok.pad_id)
        tokens = program.generate(params, prompt, prompt_lengths, max_new_tokens=data.completion,
                                  key=data.key(step), eos_ids=(tok.eos_id,), pad_id=tok.pad_id, **data.sampling)
        t1 = time.perf_counter()
        lengths, ended = completion_lengths(tokens[:, data.prompt_width:], (tok.eos_id,))
        completions, ids = data.completions(tokens[:, data.prompt_width:], lengths)
        prompts, columns = data.columns(indices)
        per_function = score(data.functions, prompts, completions, ids, columns)  # [completions, functions]
        rewards, advantage, std = group_rewards(per_function, data.weights, data.group, data.scale, data.aggregation)
        host = {**rollout_rows(tokens, prompt_lengths, lengths, data.prompt_width, tok.pad_id),
                "advantages": advantage, "weights": np.ones(len(tokens), np.float32)}
        if data.mask_truncated:  # TRL's mask_truncated_completions: they stay in the groups, out of the loss
            cut = truncated(tokens[:, data.prompt_width:], lengths, ended, tok.pad_id)
            host["loss_mask"] = host["loss_mask"] * (~cut)[:, None].astype(np.float32)
        task = program.task
        if task.num_iterations > 1:  # the old policy's log-probs: these params, once per rollout
            host["old_logps"] = np.asarray(program.compiled_old_logps_step()(params, program.place(host))["old_logps"])
        if task.beta:  # the reference's: a frozen copy, or these params with the LoRA adapters off
            reference = self.reference_params if self.reference_params is not None else params
            host["ref_logps"] = np.asarray(program.compiled_reference_step()(reference, program.place(host))["ref_logps"])
        t2 = time.perf_counter()
        mean, spread = nan_mean_std(rewards, 0)  # NaN: a completion no function scored, left out as TRL does
        metrics = {"reward": float(mean[0]), "reward_std": float(spread[0]),
                   "frac_reward_zero_std": float(np.isclose(std, 0.0).mean())}
        for j, f in enumerate(data.functions):
            mean, spread = nan_mean_std(per_function[:, j], 0)
            metrics[f"rewards/{f.name}/mean"] = float(mean[0])
            metrics[f"rewards/{f.name}/std"] = float(spread[0])
        metrics.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                        "completions/max_length": float(lengths.max()),
                        "completions/clipped_ratio": float((~ended).mean()),
                        "time/sampling_s": t1 - t0, "time/scoring_s": t2 - t1})
        return host, metrics
