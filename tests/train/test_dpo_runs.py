"""DPO runs end to end (``shardzoo train --task dpo``): exact resume; --reference DIR; the reference
log-probs precomputed and stored with the run; LoRA DPO whose reference (the base, adapters off)
costs no parameter bytes in the plan and whose merged export loads in transformers."""

import json
import os
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(__file__))
from dpo_fixtures import TEXT_PAIRS, save_llama, save_tokenizer, write_jsonl  # noqa: E402

from shardzoo.train.config import TrainConfig  # noqa: E402
from shardzoo.train.io.hf_io import export_hf  # noqa: E402
from shardzoo.train.launch import DONE, prepare, run  # noqa: E402

SEQ = 40


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dporuns")
    tok = save_tokenizer(root / "tok")
    save_llama(root / "policy", len(tok), seed=0, tokenizer=tok)
    save_llama(root / "reference", len(tok), seed=1, tokenizer=tok)
    return root, write_jsonl(root / "pairs.jsonl", TEXT_PAIRS * 4)


def settings(root, pairs, out, **kw):
    base = dict(out=str(root / out), init_from=str(root / "policy"), task="dpo", data=pairs, batch_size=8,
                seq_len=SEQ, steps=4, lr=1e-2, warmup_steps=0, schedule="constant", log_every=1, save_every=2,
                eval_every=0)
    return TrainConfig(**{**base, **kw})


def records(root, out):
    with open(root / out / "metrics.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


def quiet(cfg):
    result = run(cfg, log=lambda line: None)
    assert result.status == DONE, result.message
    assert ", rewards/accuracies " in result.message and ", rewards/margins " in result.message, result.message
    return result


@pytest.fixture(scope="module")
def straight(dirs):
    root, pairs = dirs
    quiet(settings(root, pairs, "straight", reference=str(root / "reference")))
    return records(root, "straight")


def test_a_resumed_dpo_run_equals_the_uninterrupted_one(dirs, straight):
    root, pairs = dirs
    quiet(settings(root, pairs, "resumed", reference=str(root / "reference"), steps=2))
    quiet(settings(root, pairs, "resumed", reference=str(root / "reference")))
    resumed = records(root, "resumed")
    for step in (3, 4):
        for key in ("loss", "rewards/chosen", "rewards/margins", "logps/rejected", "grad_norm"):
            assert resumed[step][key] == straight[step][key], (step, key)
    assert straight[4]["loss"] < straight[1]["loss"]  # it learns


def test_reference_dir_differs_from_the_initial_policy(dirs, straight):
    root, pairs = dirs
    quiet(settings(root, pairs, "selfref", steps=1))
    own = records(root, "selfref")[1]
    # the initial policy as its own reference: every reward is 0 and the loss log 2 at step 1
    assert own["loss"] == pytest.approx(np.log(2), abs=1e-6) and own["rewards/margins"] == 0.0
    assert abs(straight[1]["rewards/margins"]) > 0.05


def test_precomputed_reference_is_stored_and_gives_the_same_first_step(dirs, straight):
    root, pairs = dirs
    quiet(settings(root, pairs, "pre", reference=str(root / "reference"), precompute_reference=True, steps=2))
    stored = root / "pre" / "reference_logps.npy"
    logps = np.load(stored)
    assert logps.shape == (16, 2) and np.all(logps < 0)
    first = records(root, "pre")[1]
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"):
        assert first[key] == pytest.approx(straight[1][key], abs=1e-5), key
    # a resume reads the stored log-probs back (the file is not rewritten) and continues
    mtime = os.stat(stored).st_mtime_ns
    quiet(settings(root, pairs, "pre", reference=str(root / "reference"), precompute_reference=True))
    assert os.stat(stored).st_mtime_ns == mtime and set(records(root, "pre")) == {1, 2, 3, 4}
    # the plan holds no reference model while training
    program = prepare(settings(root, pairs, "plan-pre", precompute_reference=True)).program
    assert program.plan().totals["reference"] == 0


LORA = dict(lora_rank=4, lora_alpha=8.0)


@pytest.fixture(scope="module")
def held_runs(dirs):
    """Runs of 3 steps with a quarter of the pairs held out, by kind of reference, each trained
    once (the LoRA one serves the LoRA test and its eval test): the out dir's name."""
    root, pairs = dirs
    done = {}

    def held_run(kind):
        if kind not in done:
            extra = LORA if kind == "lora" else dict(reference=str(root / "reference"))
            done[kind] = f"held-{kind.split()[0]}"
            quiet(settings(root, pairs, done[kind], steps=3, eval_fraction=0.25, **extra))
        return done[kind]

    return held_run


def test_lora_dpo_reference_costs_no_parameter_bytes_and_its_merged_export_loads(dirs, held_runs):
    root, pairs = dirs
    plan = prepare(settings(root, pairs, "plan-lora", **LORA)).program.plan()
    assert plan.totals["reference"] == 0 and "reference model" in plan.format()
    full = prepare(settings(root, pairs, "plan-full")).program.plan()
    assert full.totals["reference"] == full.totals["params"] > 0  # a frozen copy, sharded as the params
    out = held_runs("lora")
    first = records(root, out)[1]
    assert first["loss"] == pytest.approx(np.log(2), abs=1e-6)  # B = 0: the policy is its base at step 1
    assert records(root, out)[3]["rewards/margins"] != 0.0
    export_hf(str(root / out), str(root / "merged"), merge_lora=True)
    merged = AutoModelForCausalLM.from_pretrained(str(root / "merged"))
    base = AutoModelForCausalLM.from_pretrained(str(root / "policy"))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[q], base.state_dict()[q])  # the adapters trained and merged
    with torch.no_grad():
        assert torch.isfinite(merged(torch.tensor([[1, 5, 9]])).logits).all()


def test_a_reference_of_another_architecture_is_refused_before_anything_is_written(dirs, tmp_path):
    from shardzoo.errors import UserError

    root, pairs = dirs
    save_llama(tmp_path / "other", 200, seed=2)
    with pytest.raises(UserError, match=r"--reference .*other: not the policy's architecture: vocab_size 200"):
        prepare(settings(root, pairs, "bad-ref", reference=str(tmp_path / "other")))
    assert not os.path.exists(root / "bad-ref")


# ------------------------------------------------------------------ shardzoo eval of DPO runs
def eval_metrics(**kw):
    from shardzoo.train import evaluate

    return evaluate.run(evaluate.EvalSettings(**kw))


@pytest.mark.parametrize("kind", ["frozen copy", "lora"])
def test_eval_of_a_dpo_run_equals_its_final_held_out_metrics(dirs, held_runs, kind):
    """``shardzoo eval --checkpoint RUN --split eval`` scores the run's held-out pairs against the
    reference it trained with (a --reference dir; under LoRA the base, adapters off) and gives the
    trainer's last eval_* within 1e-5."""
    root, _ = dirs
    out = held_runs(kind)
    final = [r for r in map(json.loads, open(root / out / "metrics.jsonl")) if "eval_loss" in r][-1]
    metrics = eval_metrics(checkpoint=str(root / out), split="eval")
    assert metrics["task"] == "dpo" and metrics["pairs"] == 4 and metrics["split"] == "eval"
    assert metrics["reference"] == ("the base (adapters off)" if kind == "lora" else "frozen copy")
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected"):
        assert metrics[key] == pytest.approx(final[f"eval_{key}"], abs=1e-5), key
    assert metrics["rewards/margins"] != 0.0  # the policy moved away from its reference


def test_eval_task_dpo_of_hf_models_names_its_reference(dirs):
    from shardzoo.errors import UserError
    from shardzoo.train.evaluate import format_metrics

    root, pairs = dirs
    # a model against itself: every reward 0, the sigmoid loss log 2 on every pair
    same = eval_metrics(hf=str(root / "policy"), task="dpo", reference=str(root / "policy"), data=pairs, seq_len=SEQ)
    assert same["pairs"] == 16 and same["loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert same["rewards/margins"] == pytest.approx(0.0, abs=1e-6) and same["logps/chosen"] < 0
    other = eval_metrics(hf=str(root / "policy"), task="dpo", reference=str(root / "reference"), data=pairs,
                         seq_len=SEQ)
    assert abs(other["rewards/margins"]) > 0.05 and other["logps/chosen"] == pytest.approx(same["logps/chosen"],
                                                                                          abs=1e-4)
    assert format_metrics(other).startswith("dpo (sigmoid, beta 0.1, reference: frozen copy) over 16 pairs")
    with pytest.raises(UserError, match=r"--task dpo of a model that did not train on preference pairs needs "
                                        r"--reference DIR"):
        eval_metrics(hf=str(root / "policy"), task="dpo", data=pairs)
