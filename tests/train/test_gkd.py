"""On-policy distillation (``--task distill --lmbda/--seq-kd``, TRL's GKDTrainer, fp32): with
lmbda=1 a step's completions are the student's own samples, its rows and loss mask are TRL's
``generate_on_policy_outputs`` of those samples and its loss is TRL's ``GKDTrainer.compute_loss``
on transformers' student and teacher (another family) within 1e-5; with ``--seq-kd`` the teacher
samples; lmbda splits the steps; a run mixing sampled and data completions trains and resumes exactly."""

import functools
import json
import os
import sys
import types

import jax
import numpy as np
import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

sys.path.insert(0, os.path.dirname(__file__))
from dpo_fixtures import save_llama, save_tokenizer, write_jsonl  # noqa: E402
from test_distill import save_qwen2  # noqa: E402

from shardzoo.data import load_tokenizer  # noqa: E402
from shardzoo.errors import UserError  # noqa: E402
from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.train.config import TrainConfig  # noqa: E402
from shardzoo.train.io.hf_io import load_hf  # noqa: E402
from shardzoo.train.launch import DONE, run  # noqa: E402
from shardzoo.train.optim import make_optimizer  # noqa: E402
from shardzoo.train.program import Program  # noqa: E402
from shardzoo.train.tasks.distill import distill_task  # noqa: E402
from shardzoo.train.tasks.gkd import GKDTrainer, gkd_data  # noqa: E402

BATCH, PROMPT, COMPLETION = 4, 3, 8  # every prompt cut to its last 3 tokens: rows without left padding
ROWS = [("The sky is", " blue."), ("What sat on the mat?", " The cat."), ("Say yes", " yes yes"),
        ("The dog ran", " far away quickly."), ("What color is the sky?", " green and red."), ("Say no", " no")]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gkd")
    tok = save_tokenizer(root / "tok")
    student = save_llama(root / "student", len(tok), seed=0, tokenizer=tok)
    teacher = save_qwen2(root / "teacher", len(tok), seed=1)
    tok.save_pretrained(str(root / "teacher"))
    data = write_jsonl(root / "rows.jsonl", [{"prompt": p, "completion": c} for p, c in ROWS])
    return types.SimpleNamespace(root=root, tok=tok, student=student, teacher=teacher, data=data)


def settings(hf, **kw):
    base = dict(task="distill", teacher=str(hf.root / "teacher"), data=hf.data, tokenizer=str(hf.root / "tok"),
                batch_size=BATCH, seq_len=PROMPT + COMPLETION, max_prompt_length=PROMPT,
                max_completion_length=COMPLETION, lmbda=1.0, lr=1e-3, warmup_steps=0, schedule="constant")
    return TrainConfig(**{**base, **kw})


def programs(hf, mesh_spec="data=1", rules="dp"):
    devices = jax.devices()[:1] if mesh_spec == "data=1" else jax.devices()
    mesh, rules = make_mesh(mesh_spec, devices=devices), get_rules(rules)
    _, config, params = load_hf(str(hf.root / "student"), mesh=mesh, rules=rules)
    _, teacher_config, teacher_params = load_hf(str(hf.root / "teacher"), mesh=mesh, rules=rules)
    program = Program(config, rules, mesh, optimizer=functools.partial(make_optimizer, settings(hf)),
                      task=distill_task(beta=0.5), batch_size=BATCH, seq_len=PROMPT + COMPLETION,
                      teacher=teacher_config)
    return types.SimpleNamespace(program=program, params=params, teacher_params=teacher_params,
                                 tokenizer=load_tokenizer(str(hf.root / "tok")))


@pytest.fixture(scope="module")
def setup(hf):
    return programs(hf)


def first_step_loss(setup, host) -> float:
    program = setup.program
    placed = program.place_global(host)
    placed.update(program.teacher.compiled_step()(setup.teacher_params, placed))
    state = program.init(np.zeros(2, np.uint32), params=setup.params)
    _, metrics = program.compiled_train_step()(state, placed, np.zeros(2, np.uint32))
    return float(metrics["distill_loss"])


def gkd_batch(hf, setup, step=0, **kw):
    """``GKDTrainer.batch`` of the first prompts, on a stand-in for the trainer."""
    data = gkd_data(settings(hf, **kw), setup.tokenizer)
    trainer = types.SimpleNamespace(train_data=data, program=setup.program, reference_params=setup.teacher_params)
    indices = next(data)
    host, metrics = GKDTrainer.batch(trainer, setup.params, indices, step)
    return data, indices, host, metrics


def trl_rows(tokens):
    """TRL GKDTrainer.generate_on_policy_outputs of the sampled ``tokens`` (prompt of PROMPT tokens first)."""
    from trl.experimental.gkd import GKDTrainer as TRLGKD

    sampler = types.SimpleNamespace(generate=lambda **_: types.SimpleNamespace(sequences=torch.tensor(tokens)))
    inputs = {"prompts": torch.tensor(tokens[:, :PROMPT]), "prompt_attention_mask": torch.ones(len(tokens), PROMPT)}
    return TRLGKD.generate_on_policy_outputs(sampler, inputs, types.SimpleNamespace(eos_token_id=2))


def test_lmbda_one_trains_on_the_students_samples_with_trls_gkd_loss(hf, setup):
    data, indices, host, metrics = gkd_batch(hf, setup)
    assert data.mode(0) == "student" and metrics["on_policy"] == 1.0
    prompt = np.stack([data.prompts.ids[i] for i in indices])
    assert prompt.shape == (BATCH, PROMPT)
    sampled = setup.program.decoding.generate(setup.params, prompt, max_new_tokens=COMPLETION, key=data.key(0), eos_ids=(2,),
                                     pad_id=0, temperature=1.0)
    real = host["segment_ids"] > 0
    np.testing.assert_array_equal(np.where(real, host["inputs"], 0), np.where(real, sampled, 0))  # the student's
    assert host["weights"][:, PROMPT - 1:].sum(1).min() >= 1  # every row has completion tokens
    input_ids, attention_mask, labels = trl_rows(sampled)
    np.testing.assert_array_equal(host["weights"][:, :-1], (labels[:, 1:] != -100).numpy())  # TRL's loss tokens
    np.testing.assert_array_equal(attention_mask.numpy(), real)

    from trl.experimental.gkd import GKDTrainer as TRLGKD

    trl = types.SimpleNamespace(teacher_model=hf.teacher, beta=0.5, generalized_jsd_loss=TRLGKD.generalized_jsd_loss)
    with torch.no_grad():
        want = float(TRLGKD.compute_loss(trl, hf.student, {"input_ids": input_ids, "attention_mask": attention_mask,
                                                            "labels": labels}))
    got = first_step_loss(setup, host)
    assert want > 1e-2 and abs(got - want) < 1e-5, (got, want)


def test_an_on_policy_step_under_fsdp_tp_on_8_devices_equals_one_device(hf, setup):
    """The student's samples and the step's loss: the same under fsdp_tp on 8 devices."""
    _, _, one, _ = gkd_batch(hf, setup)
    eight = programs(hf, "fsdp=4,tensor=2", "fsdp_tp")
    _, _, host, _ = gkd_batch(hf, eight)
    np.testing.assert_array_equal(host["inputs"], one["inputs"])
    assert abs(first_step_loss(eight, host) - first_step_loss(setup, one)) < 1e-5


def test_seq_kd_samples_with_the_teacher_and_lmbda_splits_the_steps(hf, setup):
    data, indices, host, metrics = gkd_batch(hf, setup, lmbda=0.0, seq_kd=True)
    assert data.mode(0) == "teacher" and metrics["on_policy"] == 0.0
    prompt = np.stack([data.prompts.ids[i] for i in indices])
    teacher = Program(setup.program.teacher.config, setup.program.rules, setup.program.mesh, batch_size=BATCH,
                      seq_len=PROMPT + COMPLETION)
    sampled = teacher.decoding.generate(setup.teacher_params, prompt, max_new_tokens=COMPLETION, key=data.key(0),
                               eos_ids=(2,), pad_id=0, temperature=1.0)
    student = setup.program.decoding.generate(setup.params, prompt, max_new_tokens=COMPLETION, key=data.key(0),
                                     eos_ids=(2,), pad_id=0, temperature=1.0)
    real = host["segment_ids"] > 0
    np.testing.assert_array_equal(np.where(real, host["inputs"], 0), np.where(real, sampled, 0))
    assert not np.array_equal(sampled, student)
    half = gkd_data(settings(hf, lmbda=0.5), setup.tokenizer)
    modes = [half.mode(step) for step in range(400)]
    assert set(modes) == {"student", "data"} and 0.4 < modes.count("student") / 400 < 0.6


def test_data_completions_and_their_errors(hf, setup):
    half = gkd_data(settings(hf, lmbda=0.5), setup.tokenizer)
    step = next(s for s in range(10) if half.mode(s) == "data")
    data, indices, host, metrics = gkd_batch(hf, setup, lmbda=0.5, step=step)
    assert metrics["on_policy"] == 0.0
    for row, i in enumerate(indices):
        want = setup.tokenizer.encode(ROWS[i][1]) + [2]
        start = PROMPT
        assert host["inputs"][row, start: start + len(want)].tolist() == want[:COMPLETION]
        assert host["weights"][row].sum() == min(len(want), COMPLETION)
    bare = write_jsonl(hf.root / "bare.jsonl", [{"prompt": p} for p, _ in ROWS])
    with pytest.raises(UserError, match="has no column 'completion'"):
        gkd_data(settings(hf, lmbda=0.5, data=bare), setup.tokenizer)
    gkd_data(settings(hf, lmbda=0.5, seq_kd=True, data=bare), setup.tokenizer)  # never reads them
    with pytest.raises(UserError, match="--max-prompt-length 4 must be from 1 to --seq-len - --max-completion-length = 3"):
        gkd_data(settings(hf, max_prompt_length=4), setup.tokenizer)
    with pytest.raises(UserError, match=r"--lmbda must be in \[0, 1\]"):
        settings(hf, lmbda=1.5)
    with pytest.raises(UserError, match="--lmbda is a setting of --task distill"):
        TrainConfig(task="lm", lmbda=0.5)


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


def test_an_on_policy_run_trains_and_resumes_exactly(hf):
    data = write_jsonl(hf.root / "twice.jsonl", [{"prompt": p, "completion": c} for p, c in ROWS * 2])

    def go(out, steps):  # 8 rows a step on the 8 devices
        cfg = settings(hf, out=str(hf.root / out), init_from=str(hf.root / "student"), lmbda=0.5, steps=steps,
                       data=data, batch_size=8,
                       lr=1e-2, log_every=1, save_every=2, eval_every=0)
        result = run(cfg, log=lambda line: None)
        assert result.status == DONE, result.message

    go("straight", 4)
    go("resumed", 2)
    go("resumed", 4)
    straight, resumed = records(hf.root / "straight"), records(hf.root / "resumed")
    assert {straight[s]["on_policy"] for s in straight} == {0.0, 1.0}  # both kinds of steps
    assert all(np.isfinite(r["loss"]) for r in straight.values())
    for step in (3, 4):
        for key in ("loss", "on_policy", "completions/mean_length", "grad_norm"):
            assert resumed[step][key] == straight[step][key], (step, key)


def test_plan_counts_the_samplers_cache_of_on_policy_distillation(capsys):
    from shardzoo.cli import main

    argv = ["plan", "--model", "llama-tiny", "--mesh", "fsdp=8", "--rules", "fsdp", "--batch-size", "8",
            "--seq-len", "16", "--json", "--task", "distill", "--teacher", "qwen3-tiny"]
    assert main(argv) == 0
    off = json.loads(capsys.readouterr().out)["totals"]
    assert main([*argv, "--lmbda", "0.5"]) == 0
    on = json.loads(capsys.readouterr().out)["totals"]
    assert "rollouts" not in off and on["rollouts"] > 0 and on["reference"] == off["reference"] > 0
    assert on["total"] == off["total"] - (off["activations"] or 0) + max(on["activations"] or 0, on["rollouts"])
    # --seq-kd: the teacher samples the other steps; a teacher with a larger cache (qwen3-tiny: more
    # layers or heads than llama-tiny's) sets the rollouts' bytes, a smaller one leaves the student's
    assert main([*argv, "--lmbda", "0.5", "--seq-kd"]) == 0
    kd = json.loads(capsys.readouterr().out)["totals"]
    from shardzoo.models import get_config
    from shardzoo.models.costs import decode_cache_bytes

    caches = {m: sum(decode_cache_bytes(get_config(m).arch, 8, 16, 4).values()) for m in ("llama-tiny", "qwen3-tiny")}
    assert caches["qwen3-tiny"] > 1.5 * caches["llama-tiny"]  # the teacher's cache is the larger here
    assert kd["rollouts"] == pytest.approx(on["rollouts"] * caches["qwen3-tiny"] / caches["llama-tiny"], rel=1e-3)
    assert kd["total"] == off["total"] - (off["activations"] or 0) + max(on["activations"] or 0, kd["rollouts"])


def test_a_bad_row_of_an_on_policy_run_is_one_line(hf, capsys):
    from shardzoo.cli import main

    bad = write_jsonl(hf.root / "bad.jsonl", [{"prompt": p, "completion": c} for p, c in ROWS[:3]]
                      + [{"prompt": "Say no", "completion": ""}] + [{"prompt": p, "completion": c} for p, c in ROWS])
    out = hf.root / "never"
    argv = ["train", "--task", "distill", "--teacher", str(hf.root / "teacher"), "--init-from", str(hf.root / "student"),
            "--data", bad, "--tokenizer", str(hf.root / "tok"), "--lmbda", "0.5", "--out", str(out), "--batch-size", "8",
            "--seq-len", "11", "--max-completion-length", "8", "--steps", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "row 4, column 'completion': empty completion" in err[0], err
    assert not out.exists()
