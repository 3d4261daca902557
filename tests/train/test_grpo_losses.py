"""TRL 1.16's GRPO losses and RLOO (fp32): for fixed prompts, completions, rewards, old and
reference log-probs, the first step's loss and every metric TRL logs for it equal TRL's own
``GRPOTrainer._compute_loss`` / ``RLOOTrainer`` (its rollout's rewards, KL and leave-one-out
advantages, then its loss) run on the same tiny transformers policy, within 1e-5; under fsdp_tp on
8 devices a step equals one device's; an RLOO run resumes exactly. Prompts have one length, so
TRL's left padding moves no position."""

import functools
import json
import os
import sys
import types

import jax
import numpy as np
import pytest
import torch
from datasets import Dataset

sys.path.insert(0, os.path.dirname(__file__))
from dpo_fixtures import save_llama, save_tokenizer, write_jsonl  # noqa: E402

from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.train.config import TrainConfig  # noqa: E402
from shardzoo.train.io.hf_io import load_hf  # noqa: E402
from shardzoo.train.launch import DONE, run  # noqa: E402
from shardzoo.train.optim import make_optimizer  # noqa: E402
from shardzoo.train.program import Program  # noqa: E402
from shardzoo.train.tasks.grpo import grpo_task  # noqa: E402
from shardzoo.train.tasks.reward_functions import rollout_rows  # noqa: E402
from shardzoo.train.tasks.rollouts import GRPOTrainer, Sampled  # noqa: E402

G, WIDTH, COMPLETION = 3, 4, 5
PROMPTS = [[1, 7, 9, 11], [1, 12, 5, 8]]  # one length: no left padding
COMPLETIONS = [[30, 31, 2], [14, 15, 16, 17, 18], [40, 2], [9, 9, 9, 9, 9], [22, 2], [50, 51, 52, 2]]
REWARDS = np.array([1.0, 0.0, 0.5, 2.0, -1.0, 0.25], np.float32)
ADVANTAGES = np.array([1.2, -0.9, -0.3, 1.1, -1.4, 0.3], np.float32)
BETA = 0.05
SETTINGS = TrainConfig(batch_size=6, seq_len=WIDTH + COMPLETION, lr=1e-3, warmup_steps=0, schedule="constant")
ATOL = 1e-5


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tokenizer, a policy and a different reference saved; ours loaded on one device."""
    root = tmp_path_factory.mktemp("grpo_losses")
    tok = save_tokenizer(root / "tok")
    save_llama(root / "policy", len(tok), seed=0, tokenizer=tok)
    save_llama(root / "reference", len(tok), seed=1, tokenizer=tok)
    mesh, rules = make_mesh("data=1", devices=jax.devices()[:1]), get_rules("dp")
    _, config, params = load_hf(str(root / "policy"), mesh=mesh, rules=rules)
    _, _, ref_params = load_hf(str(root / "reference"), mesh=mesh, rules=rules)
    return types.SimpleNamespace(root=root, tok=tok, config=config, params=params, ref_params=ref_params, mesh=mesh,
                                 rules=rules)


def trl_tensors():
    """TRL's layout: ``prompt_ids [B, 4]``, ``completion_ids [B, C]`` right-padded (pad 0) and its mask."""
    prompt_ids = torch.tensor([p for p in PROMPTS for _ in range(G)])
    completion_ids = torch.zeros(len(COMPLETIONS), COMPLETION, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for i, c in enumerate(COMPLETIONS):
        completion_ids[i, : len(c)], completion_mask[i, : len(c)] = torch.tensor(c), 1
    return prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask


def to_ours(x):
    """A TRL ``[B, C]`` per-completion-token array in our rows' layout ``[B, WIDTH + C]``: token k
    of a completion is the target at position WIDTH - 1 + k."""
    out = np.zeros((len(COMPLETIONS), WIDTH + COMPLETION), np.float32)
    out[:, WIDTH - 1: WIDTH - 1 + COMPLETION] = np.asarray(x, np.float32)
    return out


def our_rows():
    tokens = np.zeros((len(COMPLETIONS), WIDTH + COMPLETION), np.int32)
    tokens[:, :WIDTH] = [p for p in PROMPTS for _ in range(G)]
    for i, c in enumerate(COMPLETIONS):
        tokens[i, WIDTH: WIDTH + len(c)] = c
    lengths = np.array([len(c) for c in COMPLETIONS], np.int32)
    return tokens, rollout_rows(tokens, np.full(len(COMPLETIONS), WIDTH, np.int32), lengths, WIDTH, 0)


def program_of(hf, task, mesh=None, rules=None, params=None):
    program = Program(hf.config, rules or hf.rules, mesh or hf.mesh, task=task, batch_size=len(COMPLETIONS),
                      seq_len=WIDTH + COMPLETION, optimizer=functools.partial(make_optimizer, SETTINGS),
                      reference="copy" if task.beta else None)
    return program


def first_step(program, params, batch):
    state = program.init(np.zeros(2, np.uint32), params=params)
    _, metrics = program.compiled_train_step()(state, program.place(batch), np.zeros(2, np.uint32))
    return {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}


def trl_trainer(hf, cls, config_cls, **kw):
    """TRL's trainer on the saved policy, its reference swapped for the different one, in train mode."""
    from transformers import AutoModelForCausalLM

    args = config_cls(output_dir=str(hf.root / "trl"), bf16=False, use_cpu=True, per_device_train_batch_size=6,
                      num_generations=G, max_completion_length=COMPLETION, report_to=[], **kw)
    trainer = cls(model=str(hf.root / "policy"), reward_funcs=reward_of_row, args=args, processing_class=hf.tok,
                  train_dataset=Dataset.from_list([{"prompt": "p", "row": i} for i in range(6)]))
    if trainer.ref_model is not None:
        reference = AutoModelForCausalLM.from_pretrained(str(hf.root / "reference"))
        trainer.ref_model.load_state_dict(reference.state_dict())  # TRL's own (patched) model, other weights
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def reward_of_row(prompts, completions, row, **kw):
    return [float(REWARDS[i]) for i in row]


# (loss_type, GRPOConfig options): each of TRL 1.16's losses, GSPO, the two-sided clip, the entropy options
CASES = {
    "dapo": ("dapo", {}),
    "grpo-gspo": ("grpo", {"importance_sampling_level": "sequence"}),
    "bnpo": ("bnpo", {}),
    "dr_grpo": ("dr_grpo", {}),
    "cispo": ("cispo", {"epsilon_high": 1.1}),
    "sapo": ("sapo", {"sapo_temperature_neg": 1.3, "sapo_temperature_pos": 0.8}),
    "luspo": ("luspo", {"importance_sampling_level": "sequence"}),
    "vespo": ("vespo", {"vespo_k_pos": 1.5, "vespo_lambda_neg": 2.5}),
    "dapo-delta-entropy": ("dapo", {"delta": 1.25, "top_entropy_quantile": 0.5, "entropy_coef": 0.03}),
    "dapo-no-bias-correction": ("dapo", {"use_bias_correction_kl": False}),
}


def trl_grpo_first_step(hf, loss_type, options, shift, advantages=ADVANTAGES):
    """TRL's ``_compute_loss`` on the fixed rows: ``(loss, metrics, old, ref)``, old = the policy's
    log-probs shifted by ``shift`` (an earlier policy), ref = the reference's."""
    from trl import GRPOConfig, GRPOTrainer

    epsilon_high = options.pop("epsilon_high", 0.28)
    trainer = trl_trainer(hf, GRPOTrainer, GRPOConfig, beta=BETA, loss_type=loss_type, num_iterations=2,
                          epsilon=0.2, epsilon_high=epsilon_high, **options)
    prompt_ids, prompt_mask, completion_ids, completion_mask = trl_tensors()
    ids, attention = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, COMPLETION)
        ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, attention, COMPLETION)
    old = logps + torch.tensor(shift)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=torch.tensor(advantages), old_per_token_logps=old,
                  ref_per_token_logps=ref, num_items_in_batch=completion_mask.sum())
    loss = float(trainer._compute_loss(trainer.model, inputs).detach())
    metrics = {k: float(v[-1]) for k, v in trainer._metrics["train"].items()}
    return loss, metrics, old.numpy(), ref.numpy(), epsilon_high


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_loss_and_metrics_equal_trls_compute_loss(hf, case):
    loss_type, options = CASES[case]
    rows = np.array([-0.35, 0.3, 0.0, 0.0, 0.0, 0.0])[:, None]  # whole completions clip too (the sequence level)
    shift = (rows + np.random.default_rng(0).uniform(-0.4, 0.4, (6, COMPLETION))).astype(np.float32)
    want_loss, want, old, ref, epsilon_high = trl_grpo_first_step(hf, loss_type, dict(options), shift)
    ours = {k: v for k, v in options.items() if k != "epsilon_high"}
    task = grpo_task(loss_type, BETA, 0.2, epsilon_high, num_iterations=2, max_completion_length=COMPLETION, **ours)
    _, batch = our_rows()
    batch.update(advantages=ADVANTAGES, weights=np.ones(len(COMPLETIONS), np.float32), old_logps=to_ours(old),
                 ref_logps=to_ours(ref))
    got = first_step(program_of(hf, task), hf.params, batch)
    assert abs(got["loss"] - want_loss) < ATOL, (got["loss"], want_loss)
    assert want["kl"] > 1e-2  # a different reference: the KL term is not zero
    for name, value in want.items():
        assert abs(got[name] - value) < ATOL, (name, got[name], value)
    if loss_type in ("dapo", "grpo", "luspo") and "delta" not in options:
        assert 0 < want["clip_ratio/region_mean"] < 1  # the clipping is exercised
        assert want["clip_ratio/high_max"] > want["clip_ratio/high_mean"]  # a max over completions
    if loss_type == "cispo":
        assert 0 < want["cispo_clip_ratio"] < 1


def test_clip_ratio_low_min_over_completions_each_partly_clipped_equals_trls(hf):
    """Every completion's advantage negative and some of its tokens' ratios below 1 - epsilon:
    ``clip_ratio/low_min`` (the least clipped completion's share) is neither 0 nor the mean."""
    advantages = -np.abs(ADVANTAGES)
    shift = np.random.default_rng(1).uniform(0.0, 0.6, (6, COMPLETION)).astype(np.float32)
    shift[:, 0] = 0.5  # each completion's first token clips
    want_loss, want, old, ref, _ = trl_grpo_first_step(hf, "dapo", {}, shift, advantages)
    task = grpo_task("dapo", BETA, 0.2, 0.28, num_iterations=2, max_completion_length=COMPLETION)
    _, batch = our_rows()
    batch.update(advantages=advantages, weights=np.ones(len(COMPLETIONS), np.float32), old_logps=to_ours(old),
                 ref_logps=to_ours(ref))
    got = first_step(program_of(hf, task), hf.params, batch)
    assert 0 < want["clip_ratio/low_min"] < want["clip_ratio/low_mean"] and want["clip_ratio/high_max"] == 0
    for name in ("loss", "clip_ratio/low_min", "clip_ratio/low_mean", "clip_ratio/high_max", "clip_ratio/region_mean"):
        value = want_loss if name == "loss" else want[name]
        assert abs(got[name] - value) < ATOL, (name, got[name], value)


def test_dapo_is_the_default_loss_as_trls():
    from trl import GRPOConfig

    assert GRPOConfig.__dataclass_fields__["loss_type"].default == "dapo"
    assert grpo_task().loss == "dapo" and grpo_task(name="rloo").beta == 0.05
    from shardzoo.train.tasks.registry import run_task

    settings = TrainConfig(task="grpo", reward_funcs=("r.py:f",), batch_size=8)
    task, _ = run_task(settings).task(settings, types.SimpleNamespace(task="lm"))
    assert task.loss == "dapo" and task.importance_sampling_level == "token" and task.use_bias_correction_kl


def trl_rloo_rollout_and_step(hf, shift, **kw):
    """TRL's ``RLOOTrainer``: its rollout (rewards, KL in the reward, leave-one-out advantages) of
    the fixed completions, then ``_compute_loss`` with the old log-probs shifted per completion."""
    from trl import RLOOConfig, RLOOTrainer

    trainer = trl_trainer(hf, RLOOTrainer, RLOOConfig, beta=BETA, epsilon=0.2, epsilon_high=0.28, **kw)
    prompt_ids = [p for p in PROMPTS for _ in range(G)]
    trainer._tokenize_prompts = lambda prompts: (prompt_ids, None, {})
    trainer._generate_single_turn = lambda ids, images, fields: [list(c) for c in COMPLETIONS]
    out = trainer._generate_and_score_completions([{"prompt": "p", "row": i} for i in range(6)])
    out["old_logps"] = out["old_logps"] + torch.tensor(shift)
    loss = float(trainer._compute_loss(trainer.model, out).detach())
    metrics = {k: float(v[-1]) for k, v in trainer._metrics["train"].items()}
    return loss, metrics, out["advantages"].numpy()


def our_rloo_rollout_and_step(hf, program, shift, **data_kw):
    """Our rollout (``GRPOTrainer.rollout``, the sampler replaced by the fixed completions and
    rewards) and the first step, the old log-probs shifted at each completion's first token."""
    tokens, _ = our_rows()
    lengths = np.array([len(c) for c in COMPLETIONS], np.int32)
    sampled = Sampled(tokens, np.full(6, WIDTH, np.int32), lengths, np.ones(6, bool), REWARDS[:, None], 0.0)
    tok = types.SimpleNamespace(pad_id=0)
    data = types.SimpleNamespace(tokenizer=tok, prompts=None, weights=np.ones(1, np.float32), group=G,
                                 scale="group", aggregation="sum_then_normalize", mask_truncated=False,
                                 prompt_width=WIDTH, key=lambda step: None, sample=lambda *a: sampled,
                                 functions=[types.SimpleNamespace(name="reward_of_row")],
                                 **{"normalize_advantages": False, "reward_clip_range": None, **data_kw})
    trainer = types.SimpleNamespace(train_data=data, program=program, reference_params=hf.ref_params)
    host, metrics = GRPOTrainer.rollout(trainer, hf.params, [0, 1], 0)
    host["old_logps"] = np.array(host["old_logps"])
    host["old_logps"][:, WIDTH - 1] += shift
    return first_step(program, hf.params, host), metrics, host["advantages"]


@pytest.mark.parametrize("iterations,options", [(1, {}), (2, {}),
                                                (2, {"normalize_advantages": True, "reward_clip_range": (-0.5, 1.5)})])
def test_rloo_rollout_loss_and_metrics_equal_trls_rlootrainer(hf, iterations, options):
    """One iteration (TRL's default: the ratio is 1), and two with old log-probs shifted per
    completion (an earlier policy: some ratios clip)."""
    shift = np.array([0.5, -0.4, 0.05, -0.3, 0.35, -0.02], np.float32) * (iterations - 1)
    want_loss, want, want_adv = trl_rloo_rollout_and_step(hf, shift, **options)
    task = grpo_task(None, BETA, 0.2, 0.28, num_iterations=iterations, max_completion_length=COMPLETION, name="rloo")
    got, rollout, adv = our_rloo_rollout_and_step(hf, program_of(hf, task), shift, **options)
    np.testing.assert_allclose(adv, want_adv, atol=ATOL)
    assert abs(got["loss"] - want_loss) < ATOL, (got["loss"], want_loss)
    assert want["kl"] != 0 and (iterations == 1 or 0 < want["clip_ratio/region_mean"] < 1)
    got.update(rollout)
    for name, value in want.items():
        if name == "num_tokens" or "terminated" in name or name.startswith("completions/"):
            continue  # the sampler's (fixed here) lengths
        assert abs(got[name] - value) < ATOL, (name, got[name], value)


@pytest.mark.parametrize("name,loss", [("grpo", "vespo"), ("grpo", "dapo"), ("rloo", None)])
def test_a_step_under_fsdp_tp_on_8_devices_equals_one_device(hf, name, loss):
    task = grpo_task(loss, BETA, 0.2, 0.28, num_iterations=2, max_completion_length=COMPLETION, name=name)
    _, batch = our_rows()
    rng = np.random.default_rng(1)
    batch.update(advantages=ADVANTAGES, weights=np.ones(6, np.float32),
                 old_logps=to_ours(rng.uniform(-5, -3, (6, COMPLETION))),
                 ref_logps=to_ours(rng.uniform(-5, -3, (6, COMPLETION))))
    one = first_step(program_of(hf, task), hf.params, batch)
    mesh8, rules8 = make_mesh("fsdp=4,tensor=2"), get_rules("fsdp_tp")
    _, _, params8 = load_hf(str(hf.root / "policy"), mesh=mesh8, rules=rules8)
    batch8 = {k: np.concatenate([v, v[:2]]) for k, v in batch.items()}  # 8 rows: the mesh's batch axis
    batch8["weights"][6:] = 0.0  # the two extra rows weigh nothing
    program8 = Program(hf.config, rules8, mesh8, task=task, batch_size=8, seq_len=WIDTH + COMPLETION,
                       optimizer=functools.partial(make_optimizer, SETTINGS), reference="copy")
    eight = first_step(program8, params8, batch8)
    clipped = ("clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max")  # the extremes: real rows only
    for key in ("loss", "grad_norm", "entropy", *(("kl",) if name == "grpo" else ()), *(clipped if loss != "vespo" else ())):
        assert abs(eight[key] - one[key]) < ATOL, (key, eight[key], one[key])


WORDS = '''
def words(prompts, completions, completion_ids, **columns):
    return [sum(ch in t for ch in c) / max(len(c), 1) for c, t in zip(completions, columns["target"])]
'''


def test_a_resumed_rloo_run_samples_and_trains_as_the_uninterrupted_one(hf):
    (hf.root / "rewards.py").write_text(WORDS)
    rows = [{"prompt": p, "target": t} for p, t in [("The sky is", "aeiou"), ("Say yes", "yes"),
                                                    ("The dog ran", "xyz"), ("Say no", "no")]]
    data = write_jsonl(hf.root / "prompts.jsonl", rows * 2)

    def settings(out, **kw):
        return TrainConfig(**{**dict(out=str(hf.root / out), init_from=str(hf.root / "policy"), task="rloo",
                                     data=data, reward_funcs=(f"{hf.root / 'rewards.py'}:words",), batch_size=8,
                                     num_generations=4, seq_len=24, max_completion_length=10, steps=4, lr=1e-2,
                                     warmup_steps=0, schedule="constant", log_every=1, save_every=10, eval_every=0,
                                     num_iterations=2), **kw})

    def records(out):
        with open(hf.root / out / "metrics.jsonl") as f:
            return {r["step"]: r for r in map(json.loads, f) if "loss" in r}

    for cfg in (settings("straight"), settings("resumed", steps=3), settings("resumed")):
        result = run(cfg, log=lambda line: None)
        assert result.status == DONE, result.message
    straight, resumed = records("straight"), records("resumed")
    for key in ("loss", "reward", "kl", "entropy", "clip_ratio/region_mean", "grad_norm"):
        assert resumed[4][key] == straight[4][key], key
    assert straight[1]["kl"] == pytest.approx(0.0, abs=1e-7) and straight[3]["kl"] != 0  # the policy moved off
    from shardzoo.train import evaluate

    # shardzoo eval scores an rloo run by its rewards, as a grpo run
    got = evaluate.run(evaluate.EvalSettings(checkpoint=str(hf.root / "straight"), temperature=0.0))
    assert got["task"] == "rewards" and got["prompts"] == 8 and 0 <= got["reward"] <= 1


def test_bad_loss_settings_are_one_line_config_errors():
    import argparse

    from shardzoo.train.config import ConfigError
    from shardzoo.train.flags import add_arguments, config_from_args

    base = dict(reward_funcs=("r.py:f",), batch_size=8, num_generations=4)
    cases = [(dict(task="rloo", loss="sapo"), "--loss 'sapo': --task rloo has one loss"),
             (dict(task="rloo", sapo_temperature_neg=2.0), "--sapo-temperature-neg is a setting of --task grpo"),
             (dict(task="rloo", scale_rewards="batch"), "--scale-rewards is a setting of --task grpo"),
             (dict(task="grpo", normalize_advantages=True), "--normalize-advantages is a setting of --task rloo"),
             (dict(task="grpo", importance_sampling_level="word"), "--importance-sampling-level 'word': choose"),
             (dict(task="grpo", top_entropy_quantile=1.5), "--top-entropy-quantile must be in [0, 1], got 1.5"),
             (dict(task="rloo", reward_clip_range=(2.0, 1.0)), "--reward-clip-range takes MIN,MAX with MIN <= MAX"),
             (dict(task="lm", entropy_coef=0.1, reward_funcs=(), num_generations=8), "--entropy-coef is a setting of")]
    for kw, words in cases:
        with pytest.raises(ConfigError) as e:
            TrainConfig(**{**base, **kw})
        assert words in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = ["--task", "grpo", "--reward-funcs", "r.py:f", "--batch-size", "8", "--num-generations", "4"]
    assert config_from_args(parser.parse_args(args)).use_bias_correction_kl  # TRL's default
    cfg = config_from_args(parser.parse_args(args + ["--no-use-bias-correction-kl", "--loss", "vespo"]))
    assert not cfg.use_bias_correction_kl and cfg.loss == "vespo"


def test_shardzoo_plan_counts_rloos_reference_and_rollouts(capsys):
    from shardzoo.cli import main

    base = ["plan", "--model", "llama-tiny", "--task", "rloo", "--batch-size", "32", "--num-generations", "8",
            "--seq-len", "64", "--rules", "fsdp", "--mesh", "fsdp=8"]
    assert main(base) == 0  # TRL's RLOO default beta 0.05: a reference model
    shown = capsys.readouterr().out
    assert "reference model" in shown and "rollouts (KV cache)" in shown
    assert main(base + ["--beta", "0"]) == 0
    shown = capsys.readouterr().out
    assert "reference model" not in shown and "rollouts (KV cache)" in shown
