"""GRPO (``--task grpo``, fp32): for fixed prompts, completions and rewards, the loss, its metrics
and its gradient equal the formula computed in this file from transformers' logits (ratio,
clipping, KL, each aggregation); one iteration without a reference has a ratio of exactly 1;
sampling under fsdp_tp on 8 devices gives one device's completions; a resumed run samples and
trains as the uninterrupted one; reward-function failures are one line; LoRA GRPO's reference
costs no parameter bytes and its merged export loads in transformers."""

import functools
import json
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(__file__))
from dpo_fixtures import save_llama, save_tokenizer, write_jsonl  # noqa: E402

from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.train.config import TrainConfig  # noqa: E402
from shardzoo.train.io.hf_io import export_hf, load_hf  # noqa: E402
from shardzoo.train.launch import DONE, prepare, run  # noqa: E402
from shardzoo.train.optim import make_optimizer  # noqa: E402
from shardzoo.train.program import Program  # noqa: E402
from shardzoo.train.tasks.base import forward  # noqa: E402
from shardzoo.train.tasks.grpo import grpo_task  # noqa: E402
from shardzoo.train.tasks.reward_functions import (  # noqa: E402
    RewardError,
    RewardFunction,
    advantages,
    completion_lengths,
    group_rewards,
    left_pad,
    rollout_rows,
    score,
    truncated,
)
from shardzoo.train.trainer import Hook  # noqa: E402

G, WIDTH, COMPLETION = 3, 6, 5
PROMPTS = [[1, 7, 9], [1, 12, 5, 8, 20, 3]]
# completions of G per prompt: eos (2) ends some, others run to COMPLETION tokens
COMPLETIONS = [[30, 31, 2], [14, 15, 16, 17, 18], [40, 2], [9, 9, 9, 9, 9], [22, 2], [50, 51, 52, 2]]
REWARDS = np.array([1.0, 0.0, 0.5, 2.0, -1.0, 0.25], np.float32)
SETTINGS = TrainConfig(batch_size=6, seq_len=WIDTH + COMPLETION, lr=1e-3, warmup_steps=0, schedule="constant")
WORDS_REWARD = '''
def words(prompts, completions, completion_ids, **columns):
    """The share of the completion's characters among the target letters of the row."""
    return [sum(ch in t for ch in c) / max(len(c), 1) for c, t in zip(completions, columns["target"])]

def raises(prompts, completions, **columns):
    raise KeyError("no such column")

def on_real_completions(prompts, completions, **columns):
    if any(completions):  # the placeholder of the check before training is empty
        raise ValueError("cannot parse the answer")
    return [0.0] * len(completions)

def length(prompts, completions, completion_ids, **columns):
    return [len(ids) / 10 for ids in completion_ids]

def odd_rows(prompts, completions, completion_ids, **columns):
    """Scores every other completion; None (TRL: does not apply) for the rest."""
    return [len(ids) / 10 if i % 2 else None for i, ids in enumerate(completion_ids)]
'''


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tokenizer, a policy and a different reference (saved), prompt data and a reward file."""
    root = tmp_path_factory.mktemp("grpo")
    tok = save_tokenizer(root / "tok")
    policy = save_llama(root / "policy", len(tok), seed=0, tokenizer=tok)
    reference = save_llama(root / "reference", len(tok), seed=1, tokenizer=tok)
    rows = [{"prompt": p, "target": t} for p, t in
            [("The sky is", "aeiou"), ("Say yes", "yes"), ("What color is the sky?", "blue"),
             ("The dog ran", "xyz"), ("The cat sat on", "mat"), ("Say no", "no")]]
    (root / "rewards.py").write_text(WORDS_REWARD)
    return types.SimpleNamespace(root=root, tok=tok, policy=policy, reference=reference,
                                 prompts=write_jsonl(root / "prompts.jsonl", rows * 2),
                                 reward=str(root / "rewards.py"))


def rollout_batch(advantage, pad=0):
    """The batch of PROMPTS x G with COMPLETIONS, as the rollout builds it."""
    prompt, lengths = left_pad([p for p in PROMPTS for _ in range(G)], WIDTH, pad)
    tokens = np.full((len(COMPLETIONS), WIDTH + COMPLETION), pad, np.int32)
    tokens[:, :WIDTH] = prompt
    for i, c in enumerate(COMPLETIONS):
        tokens[i, WIDTH: WIDTH + len(c)] = c
    counts = np.array([len(c) for c in COMPLETIONS], np.int32)
    return {**rollout_rows(tokens, lengths, counts, WIDTH, pad), "advantages": advantage,
            "weights": np.ones(len(COMPLETIONS), np.float32)}


def torch_logps(model, grad=False):
    """Per completion, transformers' log-probs of its tokens (each row unpadded)."""
    out = []
    with torch.set_grad_enabled(grad):
        for i, c in enumerate(COMPLETIONS):
            prompt = PROMPTS[i // G]
            ids = torch.tensor([prompt + c])
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            out.append(logp[len(prompt) - 1: -1].gather(-1, torch.tensor(c)[:, None])[:, 0])
    return out


def torch_loss(policy, reference, advantage, old_shift, loss_type, beta, eps=0.2, eps_high=0.28):
    """TRL's ``_compute_loss`` formula, written here on transformers' logits: ``(loss, kl, clip)``;
    the KL term times the ratio, as TRL 1.16's default ``use_bias_correction_kl``."""
    logps = torch_logps(policy, grad=True)
    refs = torch_logps(reference) if beta else None
    per_row, tokens, kl_sum, low_sum, high_sum = [], 0, 0.0, 0.0, 0.0
    for i, lp in enumerate(logps):
        old = lp.detach() + torch.tensor(old_shift[i][: len(lp)])
        ratio = torch.exp(lp - old)
        a = float(advantage[i])
        loss = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps, 1 + eps_high) * a)
        if beta:
            d = refs[i] - lp
            kl = (torch.exp(d) - d - 1) * ratio
            loss = loss + beta * kl
            kl_sum += float(kl.detach().sum())
        low_sum += float(((ratio < 1 - eps) & (a < 0)).sum())
        high_sum += float(((ratio > 1 + eps_high) & (a > 0)).sum())
        per_row.append(loss)
        tokens += len(lp)
    if loss_type == "grpo":
        total = torch.stack([r.mean() for r in per_row]).mean()
    elif loss_type == "bnpo":
        total = torch.cat(per_row).sum() / tokens
    else:
        total = torch.cat(per_row).sum() / (len(per_row) * COMPLETION)
    policy.zero_grad()
    total.backward()
    return float(total.detach()), kl_sum / tokens, (low_sum + high_sum) / tokens, low_sum / tokens


@pytest.fixture(scope="module")
def ours(hf):
    mesh, rules = make_mesh("data=1", devices=jax.devices()[:1]), get_rules("dp")
    _, config, params = load_hf(str(hf.root / "policy"), mesh=mesh, rules=rules)
    _, _, ref_params = load_hf(str(hf.root / "reference"), mesh=mesh, rules=rules)
    return types.SimpleNamespace(config=config, params=params, ref_params=ref_params, mesh=mesh, rules=rules,
                                 policy_dir=hf.root / "policy")


def program_of(ours, task, mesh=None, rules=None):
    return Program(ours.config, rules or ours.rules, mesh or ours.mesh, task=task, batch_size=len(COMPLETIONS),
                   seq_len=WIDTH + COMPLETION, optimizer=functools.partial(make_optimizer, SETTINGS),
                   reference="copy" if task.beta else None)


def test_advantages_are_trls_group_normalisation():
    adv, std = advantages(REWARDS, G, "group")
    groups = REWARDS.reshape(-1, G)
    want = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(adv, want.ravel(), atol=1e-6)
    plain, _ = advantages(REWARDS, G, "none")
    np.testing.assert_allclose(plain, (groups - groups.mean(1, keepdims=True)).ravel(), atol=1e-6)
    batch, _ = advantages(REWARDS, G, "batch")
    np.testing.assert_allclose(batch, plain / (REWARDS.std(ddof=1) + 1e-4), atol=1e-6)


def trl_group_rewards(per_function, weights, group, scale, aggregation):
    """TRL's ``GRPOTrainer._generate_and_score_completions`` reward aggregation (trl 1.16), in torch
    with TRL's own ``nanstd``: ``(rewards, advantages)``."""
    from trl.trainer.utils import nanstd

    per_function, weights = torch.tensor(per_function), torch.tensor(weights)
    unscorable = torch.isnan(per_function).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (per_function * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
        std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0) if scale != "batch" \
            else nanstd(rewards).expand_as(rewards)
        adv = rewards - mean
        if scale != "none":
            adv = adv / (std + 1e-4)
    else:
        grouped = per_function.view(-1, group, per_function.shape[1])
        reward_k = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
        summed = (reward_k.view(-1, per_function.shape[1]) * weights.unsqueeze(0)).nansum(dim=1)
        summed[unscorable] = torch.nan
        adv = (summed - torch.nanmean(summed)) / (nanstd(summed).expand_as(summed) + 1e-4)
    logged = (per_function * weights.unsqueeze(0)).nansum(dim=1)
    logged[unscorable] = torch.nan
    return logged.numpy(), torch.nan_to_num(adv, nan=0.0).numpy()


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_rewards_with_none_and_both_aggregations_equal_trls(aggregation):
    """Two functions over two groups of 4; the second does not apply (None: NaN) to some
    completions, neither to completion 5: it gets advantage 0 and stays out of its group's mean."""
    nan = np.nan
    per_function = np.array([[1.0, 0.5], [0.0, nan], [2.0, 1.5], [0.5, nan],
                             [1.5, 0.0], [nan, nan], [0.25, 1.0], [3.0, nan]], np.float32)
    weights = np.array([1.0, 0.5], np.float32)
    for scale in ("group", "batch", "none"):
        rewards, adv, _ = group_rewards(per_function, weights, 4, scale, aggregation)
        want_rewards, want_adv = trl_group_rewards(per_function, weights, 4, scale, aggregation)
        np.testing.assert_allclose(rewards, want_rewards, atol=1e-6)  # NaN where TRL has NaN
        np.testing.assert_allclose(adv, want_adv, atol=1e-5)
        assert adv[5] == 0.0 and np.isfinite(adv).all() and np.abs(adv).max() > 0.1, scale
        if aggregation == "normalize_then_sum":
            break  # TRL's normalize_then_sum always normalises over the batch
    if aggregation == "normalize_then_sum":  # not the other aggregation's advantages, the same logged rewards
        other_rewards, other, _ = group_rewards(per_function, weights, 4, "batch", "sum_then_normalize")
        assert np.abs(other - adv).max() > 1e-2
        np.testing.assert_allclose(other_rewards, rewards, atol=1e-6)


def jitted_outputs(task, module, params, placed):
    """The model call's outputs (``forward``'s first item), jitted: one compile costs less than
    the model's ops dispatched one by one."""
    return jax.jit(lambda p, b: forward(task, module, p, b, jax.random.PRNGKey(0), deterministic=True)[0])(
        params, placed)


def test_truncated_completions_are_trls_and_leave_the_loss(ours):
    """TRL's ``mask_truncated_completions``: a completion whose last token is neither an eos nor the
    pad token is masked. With one iteration (ratio 1) the loss is -A averaged as each aggregation
    says over the completions (grpo, dr_grpo: all of them) or the tokens that still score (bnpo)."""
    completions = np.zeros((len(COMPLETIONS), COMPLETION), np.int32)
    for i, c in enumerate(COMPLETIONS):
        completions[i, : len(c)] = c
    completions[3, -1] = 0  # ran to the end on a pad token: TRL does not count it as truncated
    lengths, ended = completion_lengths(completions, (2,))
    cut = truncated(completions, lengths, ended, pad_id=0)
    trl = [int(row[:n][-1]) not in (2, 0) for row, n in zip(completions, lengths, strict=True)]
    assert cut.tolist() == trl == [False, True, False, False, False, False]
    advantage = np.array([1.0, -3.0, 0.5, 2.0, -1.0, 0.25], np.float32)
    batch = rollout_batch(advantage)
    batch["loss_mask"] = batch["loss_mask"] * (~cut)[:, None]
    tokens = np.array([len(c) for c in COMPLETIONS]) * (~cut)
    want = {"grpo": -(advantage * ~cut).sum() / len(cut), "bnpo": -(advantage * tokens).sum() / tokens.sum(),
            "dr_grpo": -(advantage * tokens).sum() / (len(cut) * COMPLETION)}
    program = program_of(ours, grpo_task("grpo", 0.0, max_completion_length=COMPLETION))
    placed = program.place(batch)
    outputs = jitted_outputs(program.task, program.module, ours.params, placed)
    for loss, value in want.items():
        task = grpo_task(loss, 0.0, num_iterations=1, max_completion_length=COMPLETION)
        got = task.sums(outputs, placed)["loss"] / jnp.sum(placed["weights"])
        assert float(got) == pytest.approx(value, abs=1e-6), loss


@pytest.mark.parametrize("loss", ["grpo", "bnpo", "dr_grpo"])
def test_loss_metrics_and_gradient_equal_the_formula_on_transformers_logits(hf, ours, loss):
    beta = 0.05
    advantage, _ = advantages(REWARDS, G, "group")
    rng = np.random.default_rng(0)
    old_shift = rng.uniform(-0.4, 0.4, (len(COMPLETIONS), COMPLETION)).astype(np.float32)
    want_loss, want_kl, want_clip, want_low = torch_loss(hf.policy, hf.reference, advantage, old_shift, loss, beta)
    assert 0 < want_clip < 1 and want_low > 0  # some ratios clip, on both sides: the clipping is exercised

    task = grpo_task(loss, beta, epsilon=0.2, epsilon_high=0.28, num_iterations=2, max_completion_length=COMPLETION)
    program = program_of(ours, task)
    batch = rollout_batch(advantage)
    placed = program.place(batch)
    logps = program.compiled_old_logps_step()(ours.params, placed)["old_logps"]
    mask = batch["loss_mask"] > 0
    old = np.asarray(logps).copy()
    for i in range(len(COMPLETIONS)):  # the old policy: the completion tokens' log-probs shifted
        cols = np.flatnonzero(mask[i])
        old[i, cols] += old_shift[i, : len(cols)]
    batch["old_logps"] = old
    batch["ref_logps"] = np.asarray(program.compiled_reference_step()(ours.ref_params, program.place(batch))["ref_logps"])
    placed = program.place(batch)
    state = program.init(np.zeros(2, np.uint32), params=ours.params)
    _, metrics = program.compiled_train_step()(state, placed, np.zeros(2, np.uint32))
    got = {k: float(v) for k, v in jax.device_get(metrics).items()}
    assert abs(got["loss"] - want_loss) < 1e-5, (got["loss"], want_loss)
    assert abs(got["kl"] - want_kl) < 1e-5 and want_kl > 1e-3
    assert abs(got["clip_ratio/region_mean"] - want_clip) < 1e-6
    assert abs(got["clip_ratio/low_mean"] - want_low) < 1e-6

    def objective(params):
        outputs, _, _ = forward(task, program.module, params, placed, jax.random.PRNGKey(0), deterministic=True)
        return task.sums(outputs, placed)["loss"] / jnp.sum(placed["weights"])

    grads = jax.jit(jax.grad(objective))(ours.params)
    head = np.asarray(grads["lm_head"]["kernel"]).T
    embed = np.asarray(grads["embed"]["embedding"])
    want_head = hf.policy.lm_head.weight.grad.numpy()
    want_embed = hf.policy.model.embed_tokens.weight.grad.numpy()
    assert np.abs(want_head).max() > 1e-3
    np.testing.assert_allclose(head, want_head, atol=1e-5)
    np.testing.assert_allclose(embed, want_embed, atol=1e-5)


def test_one_iteration_without_reference_has_ratio_one_and_no_clipping(ours):
    advantage = np.array([5.0, -5.0, 3.0, -3.0, 1.0, -1.0], np.float32)  # large: any ratio off 1 would clip
    task = grpo_task("grpo", 0.0, epsilon=0.2, num_iterations=1, max_completion_length=COMPLETION)
    assert task.later_keys == () and task.reference_keys == ()
    program = program_of(ours, task)
    placed = program.place(rollout_batch(advantage))
    outputs = jitted_outputs(task, program.module, ours.params, placed)
    logps = task.reference_logps(outputs, placed)
    _, ratio, kl, _ = task.per_token(logps, placed)
    assert kl is None and np.all(np.asarray(ratio) == 1.0)
    state = program.init(np.zeros(2, np.uint32), params=ours.params)
    _, metrics = program.compiled_train_step()(state, placed, np.zeros(2, np.uint32))
    metrics = jax.device_get(metrics)
    assert float(metrics["clip_ratio/region_mean"]) == 0.0 and "kl" not in metrics
    assert float(metrics["loss"]) == pytest.approx(-advantage.mean(), abs=1e-6)  # ratio 1: -mean(A)
    assert float(metrics["grad_norm"]) > 0


def test_sampling_under_fsdp_tp_on_8_devices_equals_one_device(ours):
    task = grpo_task("grpo", 0.0, max_completion_length=COMPLETION)
    prompt, lengths = left_pad([p for p in PROMPTS for _ in range(4)], WIDTH, 0)
    key = np.asarray(jax.random.key_data(jax.random.key(3)), np.uint32)
    one = program_of(ours, task).decoding.generate(ours.params, prompt, lengths, max_new_tokens=12, temperature=1.0,
                                          key=key, eos_ids=(2,), pad_id=0)
    mesh8, rules8 = make_mesh("fsdp=4,tensor=2"), get_rules("fsdp_tp")
    _, _, params8 = load_hf(str(ours.policy_dir), mesh=mesh8, rules=rules8)
    program8 = Program(ours.config, rules8, mesh8, task=task, batch_size=8, seq_len=WIDTH + COMPLETION,
                       optimizer=functools.partial(make_optimizer, SETTINGS))
    eight = program8.decoding.generate(params8, prompt, lengths, max_new_tokens=12, temperature=1.0, key=key,
                              eos_ids=(2,), pad_id=0)
    np.testing.assert_array_equal(one, eight)
    other = program8.decoding.generate(params8, prompt, lengths, max_new_tokens=12, temperature=1.0, eos_ids=(2,), pad_id=0,
                              key=np.asarray(jax.random.key_data(jax.random.key(4)), np.uint32))
    assert not np.array_equal(other, eight)  # the key decides the samples


def settings(hf, out, **kw):
    base = dict(out=str(hf.root / out), init_from=str(hf.root / "policy"), task="grpo", data=hf.prompts,
                reward_funcs=(f"{hf.reward}:words",), batch_size=8, num_generations=4, seq_len=24,
                max_completion_length=10, steps=5, lr=1e-2, warmup_steps=0, schedule="constant", log_every=1,
                save_every=10, eval_every=0)
    return TrainConfig(**{**base, **kw})


def records(hf, out):
    with open(hf.root / out / "metrics.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


def quiet(cfg, hooks=()):
    result = run(cfg, log=lambda line: None, hooks=hooks)
    assert result.status == DONE, result.message
    assert ", reward " in result.message, result.message  # the final line says what GRPO learns from
    return result


def test_a_resumed_run_samples_and_trains_as_the_uninterrupted_one(hf, capsys):
    """Two iterations per rollout: the run stops after step 3, inside the rollout of steps 3-4
    (stored with the checkpoint), and step 5 samples anew with the checkpoint's sampler key."""
    class Watch(Hook):  # what the sampler and the train step see, step by step
        seen = []

        def after_step(self, trainer, step, batch, record):
            self.seen.append((len(trainer.program.decoding._compiled), trainer.program._train_step))

    two = dict(reward_funcs=(f"{hf.reward}:words", f"{hf.reward}:length"), reward_weights=(1.0, 0.5))
    quiet(settings(hf, "straight", num_iterations=2, beta=0.02, **two), hooks=(Watch(),))
    decoders, steps = zip(*Watch.seen, strict=True)
    assert set(decoders) == {1} and len(set(map(id, steps))) == 1  # the sampler compiled once, the step once
    quiet(settings(hf, "resumed", num_iterations=2, beta=0.02, steps=3, **two))
    quiet(settings(hf, "resumed", num_iterations=2, beta=0.02, **two))
    straight, resumed = records(hf, "straight"), records(hf, "resumed")
    for step in (4, 5):
        for key in ("loss", "reward", "rewards/words/mean", "completions/mean_length", "kl", "grad_norm"):
            assert resumed[step][key] == straight[step][key], (step, key)
    assert straight[5]["reward"] != straight[3]["reward"]  # new samples every other step
    for r in straight.values():  # the weighted sum of the functions' rewards
        assert r["reward"] == pytest.approx(r["rewards/words/mean"] + 0.5 * r["rewards/length/mean"], abs=1e-6)
    assert straight[2]["clip_ratio/region_mean"] >= 0 and straight[2]["kl"] > 0  # the second pass moved off 1
    evaluate_the_run_by_its_rewards(hf, capsys)


def evaluate_the_run_by_its_rewards(hf, capsys):
    """``shardzoo eval`` of a grpo run: by default its reward functions (with their weights) on
    completions sampled for its prompts; greedy, the length reward is the mean length over 10."""
    from shardzoo.cli import main
    from shardzoo.train import evaluate

    out = hf.root / "eval.json"
    got = evaluate.run(evaluate.EvalSettings(checkpoint=str(hf.root / "straight"), temperature=0.0, out=str(out)))
    assert got == json.loads(out.read_text())
    assert got["task"] == "rewards" and got["prompts"] == 12 and got["completions"] == 12
    assert got["reward_funcs"] == [f"{hf.reward}:words", f"{hf.reward}:length"] and got["reward_weights"] == [1, 0.5]
    assert got["rewards/length/mean"] == pytest.approx(got["completions/mean_length"] / 10, abs=1e-6)
    assert got["reward"] == pytest.approx(got["rewards/words/mean"] + 0.5 * got["rewards/length/mean"], abs=1e-6)
    assert 0 < got["completions/mean_length"] <= got["max_completion_length"] == 10
    assert "rewards over 12 completions (1 per prompt of 12, greedy)" in evaluate.format_metrics(got)
    for bad, words in ((["--num-generations", "2", "--temperature", "0"], "greedy decoding gives one completion"),
                       (["--num-generations", "0"], "--num-generations must be at least 1, got 0"),
                       (["--task", "lm", "--temperature", "0.5"], "--temperature goes with --task rewards")):
        capsys.readouterr()
        assert main(["eval", "--checkpoint", str(hf.root / "straight"), *bad]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.strip().splitlines()[-1].endswith(words), err


def test_a_run_with_none_rewards_normalize_then_sum_and_truncated_completions_masked(hf):
    """The rollout's path for TRL's options: a function returning None for every other completion
    (its mean over the rest), normalize_then_sum, and completions cut at 4 tokens without an eos out
    of the loss (their rows' masks 0, the others' not)."""
    class Watch(Hook):
        seen = []

        def after_step(self, trainer, step, batch, record):
            host, _ = trainer.train_data.current
            self.seen.append((host["loss_mask"].copy(), host["inputs"].copy()))

    quiet(settings(hf, "options", steps=2, max_completion_length=4, mask_truncated_completions=True,
                   multi_objective_aggregation="normalize_then_sum",
                   reward_funcs=(f"{hf.reward}:words", f"{hf.reward}:odd_rows")), hooks=(Watch(),))
    rows = records(hf, "options")
    width, eos, pad = 24 - 4, hf.tok.eos_token_id, hf.tok.pad_token_id
    masked = kept = 0
    for mask, inputs in Watch.seen:
        completions = inputs[:, width:]  # a row: the prompt in width slots, then the 4 sampled tokens
        lengths, ended = completion_lengths(completions, (eos,))
        cut = truncated(completions, lengths, ended, pad)
        np.testing.assert_array_equal(mask.sum(1) == 0, cut)  # exactly the truncated rows leave the loss
        masked, kept = masked + int(cut.sum()), kept + int((~cut).sum())
    assert masked > 0 and kept > 0, (masked, kept)
    for r in rows.values():
        assert np.isfinite(r["rewards/odd_rows/mean"]) and np.isfinite(r["loss"])
        assert r["rewards/odd_rows/mean"] >= 0.1  # the mean of the completions it scored: lengths >= 1 over 10


def test_held_out_prompts_are_scored_while_training_and_again_by_shardzoo_eval(hf):
    """--eval-fraction 0.25 holds 3 of the 12 prompts out (a seeded choice, disjoint from the
    rest); step 1's evaluation (--eval-steps 1: one call of 2 prompts) is named *_sampled, the
    final one scores all 3; ``shardzoo eval --split eval`` of the run samples the same completions
    and gives the final eval_* (1e-6)."""
    from shardzoo.data.prompts import PromptSet, split_prompts
    from shardzoo.train import evaluate

    whole = PromptSet([np.array([i], np.int32) for i in range(12)], [f"p{i}" for i in range(12)],
                      {"target": [f"t{i}" for i in range(12)]}, False, np.zeros(12, bool))
    train, held = split_prompts(whole, 0.25, seed=0)
    assert len(held) == 3 and sorted(train.prompts + held.prompts, key=lambda p: int(p[1:])) == whole.prompts
    assert [f"t{p[1:]}" for p in held.prompts] == held.columns["target"]  # each row keeps its columns
    assert split_prompts(whole, 0.25, seed=0)[1].prompts == held.prompts != split_prompts(whole, 0.25, seed=1)[1].prompts

    quiet(settings(hf, "held_out", steps=2, eval_fraction=0.25, eval_every=1, eval_steps=1))
    rows = records(hf, "held_out")
    assert "eval_reward_sampled" in rows[1] and "eval_reward" not in rows[1]
    final = rows[2]
    assert 0 < final["eval_completions/mean_length"] <= 10 and final["eval_reward"] == final["eval_rewards/words/mean"]
    got = evaluate.run(evaluate.EvalSettings(checkpoint=str(hf.root / "held_out"), split="eval"))
    assert got["prompts"] == 3 and got["completions"] == 12 and got["num_generations"] == 4
    for name in ("reward", "reward_std", "rewards/words/mean", "completions/mean_length", "completions/clipped_ratio"):
        assert got[name] == pytest.approx(final[f"eval_{name}"], abs=1e-6), name


def test_reward_function_failures_are_one_line():
    ok = RewardFunction("ok", lambda prompts, completions, **kw: [1.0] * len(completions), "r.py:ok")
    cases = {
        "raises": (lambda prompts, completions, **kw: {}["answer"], "raised KeyError: 'answer'"),
        "short": (lambda prompts, completions, **kw: [1.0], "returned 1 rewards for 2 completions"),
        "nan": (lambda prompts, completions, **kw: [1.0, float("nan")], "returned nan for completion 1"),
        "text": (lambda prompts, completions, **kw: ["x", 1.0], "returned 'x' for completion 0, not a number"),
    }
    for name, (fn, words) in cases.items():
        with pytest.raises(RewardError) as e:
            score([ok, RewardFunction(name, fn, f"r.py:{name}")], ["p", "p"], ["a", "b"], [[1], [2]], {})
        message = str(e.value)
        assert "\n" not in message and f"reward function {name} (r.py:{name})" in message and words in message
    never = RewardFunction("never", lambda prompts, completions, **kw: [None] * len(completions), "r.py:never")
    with pytest.raises(RewardError, match=r"^reward functions never, never returned None for all 2 completions"):
        score([never, never], ["p", "p"], ["a", "b"], [[1], [2]], {})
    some = score([never, ok], ["p", "p"], ["a", "b"], [[1], [2]], {})  # None: not applicable, as TRL
    assert np.isnan(some[:, 0]).all() and (some[:, 1] == 1.0).all()


def test_a_failing_reward_function_stops_the_run_with_one_line(hf, capsys):
    """A function that raises whatever it is given (a missing column, a wrong signature) is found
    by one call before anything compiles or is written; one that raises only on real samples
    stops the run at its first rollout, with one line too."""
    from shardzoo.cli import main
    from shardzoo.errors import UserError

    def args(fn, out):
        return ["train", "--task", "grpo", "--init-from", str(hf.root / "policy"), "--data", hf.prompts,
                "--reward-funcs", f"{hf.reward}:{fn}", "--batch-size", "8", "--num-generations", "4",
                "--seq-len", "24", "--max-completion-length", "10", "--steps", "2", "--out", str(hf.root / out)]

    capsys.readouterr()
    assert main(args("raises", "raising")) == 2
    captured = capsys.readouterr()
    line = cli_one_line(captured.err)
    assert line.startswith("shardzoo train: error: reward function raises ("), line
    assert "rewards.py:raises) raised KeyError: 'no such column' when called once before training " \
        "(columns target)" in line, line
    assert captured.out == "" and not os.path.exists(hf.root / "raising")  # nothing compiled, nothing written
    assert main(args("on_real_completions", "later")) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.endswith(
        "rewards.py:on_real_completions) raised ValueError: cannot parse the answer"), err
    assert not os.path.exists(hf.root / "later" / "checkpoints" / "1")  # nothing trained on garbage
    with pytest.raises(UserError, match=r"--reward-funcs .*rewards.py:nothing: .* defines no function 'nothing'"):
        prepare(settings(hf, "missing", reward_funcs=(f"{hf.reward}:nothing",)))
    assert not os.path.exists(hf.root / "missing")


def cli_one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_lora_grpo_reference_costs_no_parameter_bytes_and_its_merged_export_loads(hf):
    lora = dict(lora_rank=4, lora_alpha=8.0, beta=0.04)
    plan = prepare(settings(hf, "plan-lora", **lora)).program.plan()
    assert plan.totals["reference"] == 0 and "reference model" in plan.format()
    assert plan.totals["rollouts"] > 0 and "rollouts (KV cache)" in plan.format()  # what sampling holds
    full = prepare(settings(hf, "plan-full", beta=0.04)).program.plan()
    assert full.totals["reference"] == full.totals["params"] > 0  # a frozen copy
    assert prepare(settings(hf, "plan-none")).program.plan().totals.get("reference") in (None, 0)
    quiet(settings(hf, "lora", steps=3, **lora))
    first = records(hf, "lora")[1]
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # B = 0: the policy is its base at step 1
    assert records(hf, "lora")[3]["kl"] > 0
    export_hf(str(hf.root / "lora"), str(hf.root / "merged"), merge_lora=True)
    merged = AutoModelForCausalLM.from_pretrained(str(hf.root / "merged"))
    base = AutoModelForCausalLM.from_pretrained(str(hf.root / "policy"))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[q], base.state_dict()[q])
    with torch.no_grad():
        assert torch.isfinite(merged(torch.tensor([[1, 5, 9]])).logits).all()


def test_conversational_prompts_are_rendered_with_the_chat_template_as_trl_does(hf):
    from datasets import Dataset

    from shardzoo.data import DataError, load_tokenizer
    from shardzoo.data.prompts import tokenize_prompts

    rows = [{"prompt": [{"role": "user", "content": "What color is the sky?"}], "answer": "blue"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say yes"}],
             "answer": "yes"}]
    tok = load_tokenizer(str(hf.root / "policy"))
    prompts = tokenize_prompts(Dataset.from_list(rows), tok, "rows", max_prompt_length=64)
    assert prompts.conversational and prompts.columns == {"answer": ["blue", "yes"]}
    for got, row in zip(prompts.ids, rows, strict=True):  # TRL: the template's text, tokenized plainly
        text = hf.tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        assert text.endswith("<|assistant|>\n")
        assert got.tolist() == hf.tok(text, add_special_tokens=False)["input_ids"]
    cut = tokenize_prompts(Dataset.from_list(rows), tok, "rows", max_prompt_length=5)
    assert [c.tolist() for c in cut.ids] == [p[-5:].tolist() for p in prompts.ids] and cut.truncated.all()
    with pytest.raises(DataError, match=r"^data 'bad': row 2, column 'prompt': empty prompt"):
        tokenize_prompts(Dataset.from_list([{"prompt": "ok"}, {"prompt": " "}]), tok, "bad", max_prompt_length=8)


def test_shardzoo_plan_shows_the_reference_and_the_rollouts_of_a_grpo_run(capsys):
    from shardzoo.cli import main

    base = ["plan", "--model", "llama-tiny", "--task", "grpo", "--batch-size", "32", "--num-generations", "8",
            "--seq-len", "64", "--rules", "fsdp", "--mesh", "fsdp=8"]
    assert main(base + ["--beta", "0.04"]) == 0
    shown = capsys.readouterr().out
    assert "reference model" in shown and "rollouts (KV cache)" in shown
    assert main(base) == 0  # --beta 0: no reference model
    shown = capsys.readouterr().out
    assert "reference model" not in shown and "rollouts (KV cache)" in shown


def test_rollouts_decode_the_train_state_params_without_a_copy(hf):
    """GRPO trains its layers unrolled (unless --override scan_layers=... says otherwise), so
    the compiled sampler reads the train state's params where they are: scanned layers would be
    cut into a copy of the layer weights inside every rollout (XLA's temporaries show it), unless
    decoding scans them (decode_layers=scan: less than one layer's weights more than unrolled).
    Under fsdp rules decoding gathers the sharded weights in either layout."""
    def sampler_temp(program):
        fn, _ = program.decoding._compile_generate((6, WIDTH), 10, 1.0, 0, 1.0, (2,), 0)
        return fn.memory_analysis().temp_size_in_bytes

    # rules dp: the params whole on every device (under fsdp decoding gathers them, either way)
    ours = prepare(settings(hf, "layout-unrolled", rules="dp")).program
    scanned = prepare(settings(hf, "layout-scanned", rules="dp", override=["scan_layers=true"])).program
    scan = prepare(settings(hf, "layout-scan", rules="dp",
                            override=["scan_layers=true", "decode_layers=scan"])).program
    assert not ours.config.execution.scan_layers and scanned.config.execution.scan_layers
    assert scan.config.execution.decode_layers == "scan" and ours.config.execution.decode_layers == "unroll"
    params = ours.abstract.params
    layers = [v for k, v in params.items() if k.startswith("layers")]
    layer_bytes = sum(x.size * x.dtype.itemsize for v in layers for x in jax.tree.leaves(v))
    assert len(layers) >= 2
    base = sampler_temp(ours)
    extra = sampler_temp(scanned) - base
    assert extra >= 0.9 * layer_bytes, (extra, layer_bytes)
    extra = sampler_temp(scan) - base
    assert extra < layer_bytes / len(layers), (extra, layer_bytes)
