"""``shardzoo eval --task rewards`` (a grpo or rloo run's default): completions sampled as the
run's rollouts are, scored by reward functions, and TRL's reward metrics over them."""

from __future__ import annotations

import math

import jax
import numpy as np

from shardzoo.errors import UserError
from shardzoo.sharding.mesh import describe_mesh
from shardzoo.train.defaults import default_seq_len
from shardzoo.train.eval_common import eval_progress
from shardzoo.train.program import Program

REWARD_FLAGS = ("reward_funcs", "reward_weights", "num_generations", "max_completion_length", "temperature",
                "top_k", "top_p")


def evaluate_rewards_run(s, run: dict, recorded: dict, config, params, mesh, rules, tokenizer) -> dict:
    """``shardzoo eval --task rewards`` (a grpo run's default): ``--num-generations`` completions
    per prompt of ``--data`` (default: the run's prompts; ``--split eval`` the ones it held out),
    sampled by the Program's decoding as the run's rollouts were (its temperature, top-k, top-p and
    completion length unless given; ``--temperature 0``: greedy), scored by the reward functions
    (default: the run's, with its weights); TRL's reward metrics over them
    (``train.rollouts.reward_metrics``). The same seed samples the same completions: with a grpo
    run's defaults (its seed, ``--num-generations``, ``--batch-size``) the ones its own
    evaluations sampled, so ``--split eval`` gives the run's final ``eval_*``."""
    from shardzoo.data import load_source
    from shardzoo.data.prompts import split_prompts, tokenize_prompts
    from shardzoo.train.tasks.reward_functions import load_reward_function
    from shardzoo.train.tasks.rollouts import (
        held_out_key,
        reward_metrics,
        sample_and_score,
        sampler_key,
    )

    settings = run.get("settings") or {}
    task, data_settings = settings.get("task") or {}, settings.get("data") or {}
    specs = s.reward_funcs or task.get("reward_funcs")
    reward_model = None if s.reward_funcs else task.get("reward_model")  # the run's, after its functions
    if not specs and not reward_model:
        raise UserError("--task rewards needs --reward-funcs FILE.py:FUNCTION[,...] (this model records none)")
    functions = [load_reward_function(spec) for spec in specs or ()]
    weights = s.reward_weights if s.reward_weights is not None else \
        (task.get("reward_weights") if not s.reward_funcs else None) or (1.0,) * (len(functions) + bool(reward_model))
    if len(weights) != len(functions) + bool(reward_model):
        raise UserError(f"--reward-weights has {len(weights)} values for {len(functions)} reward functions")
    data, split = s.data or data_settings.get("data"), s.split
    if data is None:
        raise UserError("--data SPEC of prompts is required (only a run that records its data defaults to it)")
    if split == "eval" and s.data is None and s.eval_fraction is None and data_settings.get("eval_data"):
        data, split = data_settings["eval_data"], "all"
    same = data == data_settings.get("data")
    fraction = s.eval_fraction if s.eval_fraction is not None else data_settings.get("eval_fraction") if same else None
    if split != "all" and not fraction:
        raise UserError(f"--split {split}: no prompts of {data} were held out (give --eval-fraction, or the "
                        "held-out prompts as --data)")
    temperature = s.temperature if s.temperature is not None else task.get("temperature", 1.0)
    group = s.num_generations if s.num_generations is not None else \
        (task.get("num_generations") if task.get("task") in ("grpo", "rloo") else None) or 1
    if temperature == 0 and s.num_generations is None:
        group = 1  # greedy: one completion per prompt
    if group < 1:
        raise UserError(f"--num-generations must be at least 1, got {group}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise UserError(f"--temperature must be a finite number >= 0, got {temperature}")
    if temperature == 0 and group > 1:
        raise UserError(f"--num-generations {group} at --temperature 0: greedy decoding gives one completion")
    sampling = {"temperature": float(temperature), "top_k": s.top_k if s.top_k is not None else task.get("top_k", 0),
                "top_p": s.top_p if s.top_p is not None else task.get("top_p", 1.0)}
    seq_len = s.seq_len or data_settings.get("seq_len") or default_seq_len(config, None)
    completion = s.max_completion_length or (data_settings.get("max_completion_length") if not s.seq_len else None) \
        or seq_len // 2
    width = seq_len - completion
    if width < 1:
        raise UserError(f"--max-completion-length {completion} leaves no room for a prompt in --seq-len {seq_len}")
    add_bos = s.add_bos or data_settings.get("add_bos", False)
    prompts = tokenize_prompts(load_source(data), tokenizer, data, add_bos=add_bos,
                               max_prompt_length=min(data_settings.get("max_prompt_length") or width, width),
                               skip_bad=data_settings.get("skip_missing", False))
    seed = s.seed if s.seed is not None else (settings.get("optimizer") or {}).get("seed", 0)
    if split != "all":
        train, held_out = split_prompts(prompts, fraction, seed)
        prompts = held_out if split == "eval" else train
    rows = s.batch_size or (data_settings.get("batch_size") if task.get("task") in ("grpo", "rloo") else None) \
        or mesh.size * max(1, 8 // mesh.size)
    per_call = max(1, rows // group)  # a grpo run's: its rollouts' shape (its evaluations' calls and keys)
    if reward_model:  # the run's --reward-model, sharded by these rules
        from shardzoo.train.tasks.reward import reward_model_program
        from shardzoo.train.tasks.rollouts import reward_model_function

        scored = -(-per_call * group // mesh.size) * mesh.size  # its rows: a multiple of the devices
        scorer = reward_model_program(reward_model, rules, mesh, batch_size=scored, seq_len=seq_len)
        functions.append(reward_model_function(reward_model, scorer, tokenizer))
    program = Program(config, rules, mesh)
    params = jax.device_put(params, program.shardings.params)
    parts = []
    with eval_progress(-(-len(prompts) // per_call), "rewards") as bar:
        for start in range(0, len(prompts), per_call):
            key = held_out_key(sampler_key(seed), start // per_call)
            parts.append(sample_and_score(program, params, prompts, range(start, min(start + per_call, len(prompts))),
                                          per_call, key=key, tokenizer=tokenizer, functions=functions, group=group,
                                          width=width, completion=completion, sampling=sampling))
            bar.update()
    metrics = {"task": "rewards", "prompts": len(prompts), "completions": len(prompts) * group,
               "num_generations": group,
               **reward_metrics(np.concatenate([p.rewards for p in parts]), weights, functions,
                                np.concatenate([p.lengths for p in parts]), np.concatenate([p.ended for p in parts])),
               "reward_funcs": list(specs or ()), **({"reward_model": reward_model} if reward_model else {}),
               "reward_weights": [float(w) for w in weights], **sampling,
               "max_completion_length": completion, "seq_len": seq_len, "seed": seed, "split": split, "data": data,
               "model": s.checkpoint or s.hf, "batch_size": per_call * group, "rules": rules.name,
               "mesh": describe_mesh(mesh)}
    if split != "all":
        metrics["eval_fraction"] = fraction
    return metrics


def format_rewards(metrics: dict) -> str:
    per = ", ".join(f"{k[len('rewards/'):-len('/mean')]} {v:.4f}" for k, v in metrics.items()
                    if k.startswith("rewards/") and k.endswith("/mean"))
    how = "greedy" if metrics["temperature"] == 0 else f"temperature {metrics['temperature']:g}"
    return (f"rewards over {metrics['completions']} completions ({metrics['num_generations']} per prompt of "
            f"{metrics['prompts']}, {how}): reward {metrics['reward']:.4f} (std {metrics['reward_std']:.4f}); "
            f"{per}; mean length {metrics['completions/mean_length']:.1f}, clipped "
            f"{metrics['completions/clipped_ratio']:.2f}")
