"""``--reward-model`` for ``--task grpo``/``rloo``: a reward model (here transformers'
LlamaForSequenceClassification, its own tokenizer) scores prompt + completion as TRL's GRPOTrainer
calls one, equal to transformers' scores of the same texts (1e-4) on one device and under fsdp_tp
on 8; a tiny GRPO run on its rewards trains; ``shardzoo plan`` counts its bytes."""

import os
import sys
import types

import jax
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from dpo_fixtures import save_llama, save_tokenizer, write_jsonl  # noqa: E402
from test_reward import save_reward_llama  # noqa: E402

from shardzoo.data import load_tokenizer  # noqa: E402
from shardzoo.errors import UserError  # noqa: E402
from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.train.config import TrainConfig  # noqa: E402
from shardzoo.train.launch import DONE, run  # noqa: E402
from shardzoo.train.tasks.reward import RewardModel, reward_model_program  # noqa: E402

PROMPTS = ["The sky is", "Say yes", "What color is the sky?"]
COMPLETIONS = [" blue.", " yes yes yes", " green and far away quickly."]
ROWS, SEQ = 4, 40  # one row of the scoring batch is padding; the longest text is 38 tokens


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_rm")
    tok = save_tokenizer(root / "tok")
    save_llama(root / "policy", len(tok), seed=0, tokenizer=tok)
    model = save_reward_llama(root / "rm", len(tok), tok)
    rows = [{"prompt": p} for p in ("The sky is", "Say yes", "The dog ran", "The cat sat on")]
    return types.SimpleNamespace(root=root, tok=tok, model=model, prompts=write_jsonl(root / "prompts.jsonl", rows))


def transformers_scores(hf, prompts, completions):
    """TRL GRPOTrainer._calculate_rewards's path for a reward model, on transformers."""
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    inputs = hf.tok(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        return hf.model(**inputs).logits[:, 0].float().numpy()


def scorer(hf, mesh_spec="data=1", rules="dp"):
    devices = jax.devices()[:1] if mesh_spec == "data=1" else jax.devices()
    mesh, rules = make_mesh(mesh_spec, devices=devices), get_rules(rules)
    program = reward_model_program(str(hf.root / "rm"), rules, mesh, batch_size=ROWS, seq_len=SEQ)
    return RewardModel(str(hf.root / "rm"), program, load_tokenizer(str(hf.root / "rm")))


def test_scores_equal_transformers_sequence_classification(hf):
    want = transformers_scores(hf, PROMPTS, COMPLETIONS)
    assert np.ptp(want) > 0.1  # scores that differ between the texts
    one = scorer(hf)
    assert one.name == "rm"  # TRL's name: the model path's last part (rewards/rm/mean)
    got = np.asarray(one(prompts=PROMPTS, completions=COMPLETIONS), np.float32)
    np.testing.assert_allclose(got, want, atol=1e-4)
    more = PROMPTS * 2  # more completions than one call's rows: two calls
    got = np.asarray(one(prompts=more, completions=COMPLETIONS * 2), np.float32)
    np.testing.assert_allclose(got, np.tile(want, 2), atol=1e-4)
    eight = scorer(hf, "fsdp=4,tensor=2", "fsdp_tp")
    got8 = np.asarray(eight(prompts=PROMPTS, completions=COMPLETIONS), np.float32)
    np.testing.assert_allclose(got8, want, atol=1e-4)


def records(out):
    import json

    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def run_with(hf, out, **kw):
    cfg = TrainConfig(**{**dict(out=str(hf.root / out), init_from=str(hf.root / "policy"), task="grpo",
                                data=hf.prompts, reward_model=str(hf.root / "rm"), batch_size=8, num_generations=4,
                                seq_len=24, max_completion_length=8, steps=4, lr=3e-2, warmup_steps=0,
                                schedule="constant", log_every=1, save_every=10, eval_every=0), **kw})
    history = []
    result = run(cfg, log=history.append)
    assert result.status == DONE, result.message
    return records(hf.root / out), history


def test_a_grpo_run_on_the_reward_model_trains_and_eval_scores_it(hf):
    from shardzoo.train import evaluate

    rows, history = run_with(hf, "run")
    assert len(rows) == 4 and all(np.isfinite(r["loss"]) for r in rows)
    rewards = [r["rewards/rm/mean"] for r in rows]
    assert all(r["reward"] == pytest.approx(r["rewards/rm/mean"], abs=1e-6) for r in rows)
    assert len(set(rewards)) > 1 and all(r["reward_std"] > 0 for r in rows)  # the model scored, and scores moved
    assert any("reward model" in line for line in history)  # the plan printed at the start counts it
    got = evaluate.run(evaluate.EvalSettings(checkpoint=str(hf.root / "run"), temperature=0.0))
    assert got["reward_model"] == str(hf.root / "rm") and np.isfinite(got["rewards/rm/mean"])
    assert got["reward"] == pytest.approx(got["rewards/rm/mean"], abs=1e-6)


def test_an_rloo_run_weighs_a_function_and_the_reward_model(hf):
    (hf.root / "length.py").write_text("def length(prompts, completions, completion_ids, **kw):\n"
                                       "    return [len(c) / 10 for c in completion_ids]\n")
    rows, _ = run_with(hf, "rloo", task="rloo", steps=2, reward_funcs=(f"{hf.root / 'length.py'}:length",),
                       reward_weights=(1.0, 0.5))
    for r in rows:
        assert np.isfinite(r["loss"]) and r["rewards/rm/std"] > 0
        assert r["reward"] == pytest.approx(r["rewards/length/mean"] + 0.5 * r["rewards/rm/mean"], abs=1e-5)
    with pytest.raises(UserError, match="--reward-weights has 1 values for 1 --reward-funcs and the --reward-model"):
        TrainConfig(task="grpo", reward_funcs=("a.py:f",), reward_model="rm", reward_weights=(1.0,), batch_size=8)
    with pytest.raises(UserError, match="--reward-model is a setting of --task grpo or rloo"):
        TrainConfig(task="lm", reward_model="rm")


def test_a_model_without_a_score_head_is_one_line(hf, capsys):
    from shardzoo.cli import main

    out = hf.root / "not_written"
    argv = ["train", "--task", "grpo", "--init-from", str(hf.root / "policy"), "--data", hf.prompts, "--out", str(out),
            "--reward-model", str(hf.root / "policy"), "--batch-size", "8", "--num-generations", "4", "--seq-len", "24",
            "--steps", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--reward-model" in err[0] and "not a reward model" in err[0], err
    assert not out.exists()


def test_plan_counts_the_reward_model(capsys):
    """The reward model (llama-tiny with a score head in place of its LM head) sharded by the
    run's fsdp rules: fewer bytes than the policy's params, in the total."""
    import json

    from shardzoo.cli import main

    base = ["plan", "--model", "llama-tiny", "--task", "grpo", "--batch-size", "16", "--num-generations", "8",
            "--seq-len", "32", "--rules", "fsdp", "--mesh", "fsdp=8"]
    assert main(base + ["--reward-model", "llama-tiny"]) == 0
    assert "reward model" in capsys.readouterr().out
    assert main(base + ["--reward-model", "llama-tiny", "--json"]) == 0
    with_rm = json.loads(capsys.readouterr().out)["totals"]
    assert main(base + ["--json"]) == 0
    without = json.loads(capsys.readouterr().out)["totals"]
    assert "reward_model" not in without
    assert 0 < with_rm["reward_model"] < with_rm["params"]
    assert with_rm["total"] == without["total"] + with_rm["reward_model"]
