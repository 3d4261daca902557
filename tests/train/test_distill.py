"""Distillation (``--task distill``): TRL GKD's generalized JSD, and a first train step against
the same loss on transformers' logits of a tiny Llama student and a tiny Qwen2 teacher (fp32)."""

import functools
import os
import sys
import types

import jax
import numpy as np
import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

sys.path.insert(0, os.path.dirname(__file__))
from dpo_fixtures import save_llama  # noqa: E402

from shardzoo.errors import UserError  # noqa: E402
from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.train.config import TrainConfig  # noqa: E402
from shardzoo.train.io.hf_io import load_hf  # noqa: E402
from shardzoo.train.optim import make_optimizer  # noqa: E402
from shardzoo.train.program import Program  # noqa: E402
from shardzoo.train.tasks.distill import distill_task, generalized_jsd  # noqa: E402

VOCAB, BATCH, SEQ = 96, 4, 12
SETTINGS = TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=1e-3, warmup_steps=0, schedule="constant")


def trl_jsd(student, teacher, labels, **settings):
    from trl.experimental.gkd import GKDTrainer

    return float(GKDTrainer.generalized_jsd_loss(torch.tensor(student), torch.tensor(teacher),
                                                 labels=torch.tensor(labels), **settings))


@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (0.0, 2.0), (0.5, 1.0), (0.9, 0.7), (1.0, 1.0)])
def test_generalized_jsd_equals_trl_gkd(beta, temperature):
    rng = np.random.default_rng(0)
    student = rng.normal(0, 3, (2, 5, VOCAB)).astype(np.float32)
    teacher = rng.normal(0, 3, (2, 5, VOCAB)).astype(np.float32)
    mask = np.ones((2, 5), np.float32)
    mask[0, :2] = mask[1, 4] = 0
    labels = np.where(mask > 0, 1, -100)
    ours = generalized_jsd(student, teacher, beta=beta, temperature=temperature)
    ours = float(np.sum(np.asarray(ours) * mask) / mask.sum())
    expected = trl_jsd(student, teacher, labels, beta=beta, temperature=temperature)
    assert expected > 1e-2  # the distributions differ: the comparison is not of zeros
    assert abs(ours - expected) < 1e-5 * max(1.0, abs(expected))


def test_top_k_is_the_kl_over_the_teachers_likeliest_tokens():
    rng = np.random.default_rng(1)
    student, teacher = rng.normal(0, 2, (2, 3, VOCAB)).astype(np.float32)
    ours = np.asarray(generalized_jsd(student, teacher, beta=0.0, top_k=5))
    for pos in range(3):
        log_s = torch.log_softmax(torch.tensor(student[pos]), -1)
        top = torch.topk(torch.tensor(teacher[pos]), 5)
        log_t = torch.log_softmax(top.values, -1)
        expected = float(torch.sum(log_t.exp() * (log_t - log_s[top.indices])))
        assert abs(ours[pos] - expected) < 1e-5
    assert np.all(ours != np.asarray(generalized_jsd(student, teacher, beta=0.0)))


def save_qwen2(directory, vocab: int, seed: int):
    """A tiny random Qwen2 (another family than the Llama student) in float32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    model.save_pretrained(str(directory))
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    student = save_llama(root / "student", VOCAB, seed=0)
    teacher = save_qwen2(root / "teacher", VOCAB, seed=1)
    rng = np.random.default_rng(2)
    tokens = rng.integers(3, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
    weights = np.ones((BATCH, SEQ), np.float32)
    weights[:, :4] = 0  # the prompt: no loss
    weights[1, 9:] = 0
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights,
             "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy(),
             "segment_ids": np.ones((BATCH, SEQ), np.int32)}
    return types.SimpleNamespace(root=root, student=student, teacher=teacher, batch=batch)


def first_step(hf, mesh_spec="data=1", rules="dp", grad_accum=1, **task):
    """``(metrics, program)`` of one train step from the HF weights; each setting is run once per
    module (several tests compare the same steps)."""
    task = {**dict(beta=0.0, top_k=0), **task}  # distill_task's defaults: first_step(hf) is beta 0
    key = (id(hf), mesh_spec, rules, grad_accum, tuple(sorted(task.items())))
    if key not in _STEPS:
        _STEPS[key] = _first_step(hf, mesh_spec, rules, grad_accum, **task)
    return _STEPS[key]


_STEPS = {}


def _first_step(hf, mesh_spec, rules, grad_accum, **task):
    devices = jax.devices()[:1] if mesh_spec == "data=1" else jax.devices()
    mesh, rules = make_mesh(mesh_spec, devices=devices), get_rules(rules)
    _, config, params = load_hf(str(hf.root / "student"), mesh=mesh, rules=rules)
    _, teacher_config, teacher_params = load_hf(str(hf.root / "teacher"), mesh=mesh, rules=rules)
    program = Program(config, rules, mesh, optimizer=functools.partial(make_optimizer, SETTINGS),
                      task=distill_task(**task), batch_size=BATCH, seq_len=SEQ, teacher=teacher_config,
                      grad_accum=grad_accum)
    placed = program.place(hf.batch)
    placed.update(program.teacher.compiled_step()(teacher_params, placed))
    state = program.init(np.zeros(2, np.uint32), params=params)
    _, metrics = program.compiled_train_step()(state, placed, np.zeros(2, np.uint32))
    return {k: float(v) for k, v in jax.device_get(metrics).items()}, program


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_first_step_equals_the_loss_on_transformers_logits(hf, beta):
    metrics, program = first_step(hf, beta=beta)
    with torch.no_grad():
        inputs = torch.tensor(hf.batch["inputs"], dtype=torch.long)
        student = hf.student(input_ids=inputs).logits.numpy()
        teacher = hf.teacher(input_ids=inputs).logits.numpy()
    labels = np.where(hf.batch["weights"] > 0, 1, -100)
    expected = trl_jsd(student, teacher, labels, beta=beta)
    assert expected > 1e-2
    assert abs(metrics["distill_loss"] - expected) < 1e-5 * max(1.0, expected)
    assert abs(metrics["loss"] - expected) < 1e-5 * max(1.0, expected)
    assert metrics["tokens"] == hf.batch["weights"].sum()
    # the plan counts the teacher's frozen params as the reference model's memory
    teacher_bytes = sum(np.dtype(a.dtype).itemsize * a.size for a in jax.tree.leaves(program.teacher.target))
    assert program.plan().totals["reference"] == teacher_bytes


def test_fsdp_tp_on_8_devices_equals_one_device(hf):
    one, _ = first_step(hf)
    eight, _ = first_step(hf, mesh_spec="data=2,fsdp=2,tensor=2", rules="fsdp_tp")
    for key in ("loss", "distill_loss", "grad_norm", "accuracy"):
        assert abs(one[key] - eight[key]) < 1e-5 * max(1.0, abs(one[key])), key


def test_gradient_accumulation_and_top_k_steps(hf):
    one, _ = first_step(hf, beta=0.5)
    two, _ = first_step(hf, grad_accum=2, beta=0.5)
    for key in ("loss", "distill_loss", "grad_norm"):
        assert abs(one[key] - two[key]) < 1e-5 * max(1.0, abs(one[key])), key
    top, _ = first_step(hf, top_k=8)
    whole, _ = first_step(hf)
    assert 0 < top["distill_loss"] != whole["distill_loss"]


def test_a_teacher_with_another_vocabulary_is_one_line(hf, tmp_path):
    save_qwen2(tmp_path / "other", VOCAB + 8, seed=3)
    mesh, rules = make_mesh("data=1", devices=jax.devices()[:1]), get_rules("dp")
    _, config, _ = load_hf(str(hf.root / "student"), mesh=mesh, rules=rules)
    _, teacher_config, _ = load_hf(str(tmp_path / "other"), mesh=mesh, rules=rules)
    with pytest.raises(UserError) as err:
        Program(config, rules, mesh, optimizer=functools.partial(make_optimizer, SETTINGS), task=distill_task(),
                batch_size=BATCH, seq_len=SEQ, teacher=teacher_config)
    message = str(err.value)
    assert "\n" not in message and str(VOCAB) in message and str(VOCAB + 8) in message


# --------------------------------------------------------------------------- shardzoo train --task distill
def distill_settings(root, out, **kw):
    from shardzoo.train.config import TrainConfig as Settings

    base = dict(out=str(root / out), init_from=str(root / "student"), task="distill", teacher=str(root / "teacher"),
                data=str(root / "text.jsonl"), tokenizer=str(root / "student"), batch_size=8, seq_len=16, steps=4,
                lr=1e-2, warmup_steps=0, schedule="constant", log_every=1, save_every=2, eval_every=0)
    return Settings(**{**base, **kw})


def distill_run(cfg):
    import json

    from shardzoo.train.launch import DONE, run

    result = run(cfg, log=lambda line: None)
    assert result.status == DONE, result.message
    with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A Llama student (with the tokenizer) distilled from a Qwen2 teacher on a little text."""
    from dpo_fixtures import TEXT_PAIRS, save_tokenizer, write_jsonl

    root = tmp_path_factory.mktemp("distillruns")
    tok = save_tokenizer(root / "tok")
    save_llama(root / "student", len(tok), seed=0, tokenizer=tok)
    save_qwen2(root / "teacher", len(tok), seed=1)
    write_jsonl(root / "text.jsonl", [{"text": p["prompt"] + p["chosen"] + " " + p["rejected"]}
                                      for p in TEXT_PAIRS * 8])
    return root, distill_run(distill_settings(root, "straight"))


def test_a_distill_run_learns_and_resumes_exactly(runs):
    root, straight = runs
    assert straight[4]["distill_loss"] < straight[1]["distill_loss"]  # the student nears the teacher
    distill_run(distill_settings(root, "resumed", steps=2))
    resumed = distill_run(distill_settings(root, "resumed"))
    for step in (3, 4):
        for key in ("loss", "distill_loss", "grad_norm"):
            assert resumed[step][key] == straight[step][key], (step, key)


def test_shardzoo_eval_scores_a_distill_run_as_a_language_model(runs):
    from shardzoo.train.evaluate import EvalSettings, run

    root, _ = runs
    metrics = run(EvalSettings(checkpoint=str(root / "straight"), data=str(root / "text.jsonl"), batch_size=8))
    assert metrics["task"] == "lm" and np.isfinite(metrics["loss"]) and metrics["loss"] > 0


def test_distill_needs_a_teacher_and_its_settings_belong_to_it(runs):
    from shardzoo.train.config import ConfigError

    root, _ = runs
    with pytest.raises(ConfigError, match="--teacher"):
        distill_settings(root, "x", teacher=None)
    with pytest.raises(ConfigError, match="--distill-top-k is a setting of --task distill"):
        distill_settings(root, "x", task="lm", teacher=None, distill_top_k=4)
    with pytest.raises(ConfigError, match="--beta"):
        distill_settings(root, "x", beta=1.5)
    from shardzoo.train.launch import run

    with pytest.raises(ConfigError, match="training needs the teacher's weights") as err:
        run(distill_settings(root, "named", teacher="qwen3-tiny"), log=lambda line: None)
    assert "\n" not in str(err.value)
    assert not os.path.exists(root / "named")  # nothing written


def test_plan_counts_the_teacher_and_refuses_another_vocabulary(capsys):
    import json

    from shardzoo.cli import main
    from shardzoo.models import get_config

    argv = ["plan", "--model", "llama-tiny", "--mesh", "fsdp=8", "--batch-size", "8", "--seq-len", "16", "--json"]
    assert main(argv) == 0
    alone = json.loads(capsys.readouterr().out)["totals"]
    assert main([*argv, "--task", "distill", "--teacher", "qwen3-tiny"]) == 0
    totals = json.loads(capsys.readouterr().out)["totals"]
    teacher = Program(get_config("qwen3-tiny"), get_rules("fsdp"), make_mesh("fsdp=8"), batch_size=8, seq_len=16)
    expected = sum(np.dtype(a.dtype).itemsize * int(np.prod(s.shard_shape(a.shape))) for a, s in
                   zip(jax.tree.leaves(teacher.abstract.params), jax.tree.leaves(teacher.shardings.params),
                       strict=True))
    assert totals["reference"] == expected > 0 and totals["params"] == alone["params"]
    assert main([*argv, "--task", "distill", "--teacher", "llama3.2-1b"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "128256" in err and "512" in err
