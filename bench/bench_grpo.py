"""GRPO's rollouts: sampling on the training mesh against the standalone decoding, and one GRPO
step's time split into sampling, scoring and update.

The model is bench_decode.py's random Llama (20M params, built by transformers, saved, loaded by
shardzoo). (1) Rollout throughput: a batch of 16 completions (2 prompts x 8 generations, a
32-token prompt, 128 new tokens, temperature 1, no early stop) sampled by the GRPO training
program (its optimizer, its train state: ``Program.generate`` on ``state.params``, as
``GRPOTrainer.rollout`` calls it) against the same call on a params-only Program (the standalone
decoding, as ``shardzoo generate`` runs it), in interleaved rounds after a warm-up each; medians
and their ratio (goal: >= 0.8x). (2) ``shardzoo train --task grpo`` on the same model (byte
prompts, a trivial reward): the metrics it logs per step, ``time/sampling_s`` (the rollout's
decoding), ``time/scoring_s`` (decoding to text, the reward function, advantages, and the old
and reference log-probs) and ``step_time_s`` (the whole step), the update being the rest.

    python bench/bench_grpo.py [--rounds 3] [--quick] [--out bench/results/grpo.md]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_decode import hf_model  # noqa: E402

from shardzoo.data import ByteTokenizer  # noqa: E402
from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.train.config import TrainConfig  # noqa: E402
from shardzoo.train.io.hf_io import load_hf  # noqa: E402
from shardzoo.train.optim import make_optimizer  # noqa: E402
from shardzoo.train.program import Program  # noqa: E402
from shardzoo.train.tasks.grpo import grpo_task  # noqa: E402

REWARD = "def length(prompts, completions, **columns):\n    return [len(c) / 100 for c in completions]\n"


def rollout_ab(path: str, batch: int, prompt_len: int, new: int, rounds: int) -> dict:
    """Medians (s) of the rollout's decoding on the training program and of the standalone one."""
    mesh, rules = make_mesh("data=1", devices=jax.devices()[:1]), get_rules("dp")
    _, config, params = load_hf(path, mesh=mesh, rules=rules)
    settings = TrainConfig(batch_size=batch, seq_len=prompt_len + new)
    training = Program(config, rules, mesh, optimizer=functools.partial(make_optimizer, settings), batch_size=batch,
                       seq_len=prompt_len + new, task=grpo_task(max_completion_length=new))
    state = training.init(np.zeros(2, np.uint32), params=params)
    standalone = Program(config, rules, mesh)
    prompt = np.random.default_rng(0).integers(1, config.arch.vocab_size, (batch, prompt_len)).astype(np.int32)
    key = np.asarray(jax.random.key_data(jax.random.key(0)), np.uint32)
    calls = {"rollout": lambda: training.decoding.generate(state.params, prompt, max_new_tokens=new, temperature=1.0, key=key),
             "standalone": lambda: standalone.decoding.generate(params, prompt, max_new_tokens=new, temperature=1.0, key=key)}
    first = {}
    for name, call in calls.items():
        t = time.perf_counter()
        first[name] = call()
        first[name + "_compile_s"] = time.perf_counter() - t
    times, cpu = {name: [] for name in calls}, {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t, c = time.perf_counter(), time.process_time()
            call()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    same = bool(np.array_equal(first["rollout"], first["standalone"]))
    return {"times": times, "median": {k: statistics.median(v) for k, v in times.items()}, "same": same,
            "cpu": {k: statistics.median(v) for k, v in cpu.items()},
            "compile": {k: first[k + "_compile_s"] for k in calls}}


def grpo_run(path: str, root: str, batch: int, group: int, prompt_len: int, new: int, steps: int, beta: float):
    """The per-step records of ``shardzoo train --task grpo`` on the model at ``path``."""
    from shardzoo.train.launch import run

    with open(os.path.join(root, "reward.py"), "w") as f:
        f.write(REWARD)
    rng = np.random.default_rng(0)
    with open(os.path.join(root, "prompts.jsonl"), "w") as f:
        for _ in range(64):
            f.write(json.dumps({"prompt": "".join(chr(c) for c in rng.integers(97, 123, prompt_len))}) + "\n")
    out = os.path.join(root, f"run-beta{beta}")
    cfg = TrainConfig(out=out, init_from=path, task="grpo", data=os.path.join(root, "prompts.jsonl"),
                      reward_funcs=(os.path.join(root, "reward.py") + ":length",), batch_size=batch,
                      num_generations=group, seq_len=prompt_len + new, max_completion_length=new, steps=steps,
                      beta=beta, log_every=1, eval_every=0, save_every=0, mesh="data=1", rules="dp",
                      warmup_steps=0)
    run(cfg, log=lambda line: None)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "reward" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="16 new tokens, one round, 2 steps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batch, group, prompt_len = 16, 8, 32
    new, rounds, steps = (16, 1, 2) if args.quick else (128, args.rounds, args.steps)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "model")
        hf_model(path)
        ByteTokenizer().save(path)  # the GRPO run's prompts and completions are bytes
        ab = rollout_ab(path, batch, prompt_len, new, rounds)
        runs = {beta: grpo_run(path, root, batch, group, prompt_len, new, steps, beta) for beta in (0.0, 0.04)}
    med = ab["median"]
    tokens = batch * new
    lines = [
        "## GRPO: rollouts on the training mesh, and a step's time (CPU, one device)", "",
        f"bench_decode.py's Llama (20M params, float32). {batch} completions per step ({batch // group} prompts x "
        f"{group} generations), {prompt_len}-token prompts, {new} new tokens, temperature 1, no early stop; "
        f"{rounds} interleaved rounds after a warm-up each, medians. Load average {load_start:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores (a shared machine).", "",
        "| decoding | s | tokens/s | CPU s | tokens per CPU s | first call, compile included (s) |",
        "|---|---:|---:|---:|---:|---:|",
        *(f"| {what} | {med[k]:.2f} | {tokens / med[k]:,.0f} | {ab['cpu'][k]:.2f} | {tokens / ab['cpu'][k]:,.0f} | "
          f"{ab['compile'][k]:.1f} |" for k, what in
          (("rollout", "rollout: the GRPO train program, `generate(state.params)`"),
           ("standalone", "standalone: a params-only Program, `generate(params)`"))), "",
        f"- Rollout / standalone tokens/s: **{med['standalone'] / med['rollout']:.2f}x** in wall time, "
        f"**{ab['cpu']['standalone'] / ab['cpu']['rollout']:.2f}x** in CPU time (all threads; what the load of "
        "other processes distorts least) (goal >= 0.8x); the "
        f"same tokens for the same key: {ab['same']}. Times (s) by round: rollout "
        + ", ".join(f"{x:.2f}" for x in ab["times"]["rollout"]) + "; standalone "
        + ", ".join(f"{x:.2f}" for x in ab["times"]["standalone"]) + ".", "",
        "| run | step | sampling (s) | scoring (s) | update (s) | step (s) | reward |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for beta, records in runs.items():
        for r in records:
            update = r["step_time_s"] - r["time/sampling_s"] - r["time/scoring_s"]
            lines.append(f"| beta {beta} | {r['step']} | {r['time/sampling_s']:.2f} | {r['time/scoring_s']:.2f} | "
                         f"{update:.2f} | {r['step_time_s']:.2f} | {r['reward']:.3f} |")
    lines += ["", "- `shardzoo train --task grpo` on the same model (mesh data=1, rules dp), "
              "its logged `time/sampling_s`, `time/scoring_s` and `step_time_s`; update = step - sampling - scoring "
              "(the train step and placing the batch). Step 1 includes compiling the sampler and, with beta > 0, "
              "the reference step; scoring with beta > 0 runs the frozen reference copy over the rollout.", ""]
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
