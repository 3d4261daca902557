"""``shardzoo train --task grpo`` over two processes on 127.0.0.1 (4 fake CPU devices each)
trains like one process on 8: every process samples the same completions on the global mesh,
scores them all (process 0's rewards broadcast), and feeds each device its rows of the one
rollout; the rewards, completion lengths, KL to the reference, losses and the held-out prompts'
rewards equal the one-process run's step by step (1e-5, float32)."""

import json

import pytest

from shardzoo.train.metrics import read_metrics

STEPS = 3
TOL = 1e-5
REWARD = '''
def letters(prompts, completions, completion_ids, **columns):
    """The share of the completion's characters among the row's target letters."""
    return [sum(ch in t for ch in c) / max(len(c), 1) for c, t in zip(completions, columns["target"])]
'''


def _records(out) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def test_two_process_grpo_trains_like_one_process(runner):
    root = runner.root / "grpo"
    root.mkdir()
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"say {'abcdefghijkl'[i]} {i}", "target": "aeiou" if i % 2 else "xyz"}) + "\n")
    (root / "rewards.py").write_text(REWARD)
    flags = ["--task", "grpo", "--data", str(prompts), "--reward-funcs", f"{root / 'rewards.py'}:letters",
             "--num-generations", "4", "--seq-len", "24", "--max-completion-length", "8", "--beta", "0.02",
             "--num-iterations", "2", "--eval-fraction", "0.25", "--steps", str(STEPS), "--save-every", str(STEPS),
             "--rules", "fsdp", "--mesh", "fsdp=8"]
    procs = [runner.start("grpo_single", root / "single", *flags),
             *runner.start_pair("grpo_pair", root / "pair", *flags)]
    runner.finish(procs, timeout=600)
    for name, p in zip(("grpo_single", "grpo_pair.0", "grpo_pair.1"), procs, strict=True):
        assert p.returncode == 0, f"{name} exited {p.returncode}:\n{runner.log(name)[-3000:]}"
    want, got = _records(root / "single"), _records(root / "pair")
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        for key in ("reward", "rewards/letters/mean", "completions/mean_length", "kl", "loss", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], abs=TOL), (step, key)
    assert want[STEPS]["eval_reward"] == pytest.approx(got[STEPS]["eval_reward"], abs=TOL)
    assert want[1]["reward"] != want[3]["reward"] and want[3]["kl"] > 1e-4  # new samples, off the reference
    run = json.loads((root / "pair" / "run.json").read_text())
    assert (run["processes"], run["devices"]) == (2, 8)
    assert "step 1:" in runner.log("grpo_pair.0") and "step 1:" not in runner.log("grpo_pair.1")
