"""Reward models (``--task reward``) equal TRL's RewardTrainer on the same tiny model and pairs (fp32):
the first step's loss and metrics, with a ``margin`` column and ``center_rewards_coefficient``; a
zoo Llama with ``score_head`` exports as transformers' LlamaForSequenceClassification with the
same scores; a pair without ``chosen`` is one line naming file, row and column."""

import functools
import os
import sys
import types
import warnings

import jax
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from dpo_fixtures import TEXT_PAIRS, save_tokenizer, write_jsonl  # noqa: E402

from shardzoo.data import DataConfig, load_tokenizer  # noqa: E402
from shardzoo.data.loader import make_preference_datasets  # noqa: E402
from shardzoo.errors import UserError  # noqa: E402
from shardzoo.models.hf import export_hf  # noqa: E402
from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.train.config import TrainConfig  # noqa: E402
from shardzoo.train.io.hf_io import load_hf  # noqa: E402
from shardzoo.train.optim import make_optimizer  # noqa: E402
from shardzoo.train.program import Program  # noqa: E402
from shardzoo.train.tasks.reward import METRICS, reward_task  # noqa: E402

SEQ, PAIRS, CENTER = 40, 4, 0.01
MARGINS = [0.5, 0.0, -0.25, 1.0]
SETTINGS = TrainConfig(batch_size=PAIRS, seq_len=SEQ, lr=1e-3, warmup_steps=0, schedule="constant")


def save_reward_llama(directory, vocab: int, tokenizer):
    """A tiny random LlamaForSequenceClassification (num_labels=1, pad 0) saved in float32."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_labels=1)
    model = LlamaForSequenceClassification(config).float().eval()
    with torch.no_grad():  # larger weights than the default init: rewards that differ between rows
        for p in model.parameters():
            p.mul_(3.0)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward")
    tok = save_tokenizer(root / "tok")
    model = save_reward_llama(root / "rm", len(tok), tok)
    rows = [{**r, "margin": m} for r, m in zip(TEXT_PAIRS, MARGINS, strict=True)]
    return types.SimpleNamespace(root=root, tok=tok, model=model, pairs=write_jsonl(root / "pairs.jsonl", rows))


def ours(hf, mesh_spec="data=1", rules="dp", grad_accum=1):
    """shardzoo's first train step on the pairs: ``(metrics, batch, config, params)``."""
    devices = jax.devices()[:1] if mesh_spec == "data=1" else jax.devices()
    mesh, rules = make_mesh(mesh_spec, devices=devices), get_rules(rules)
    _, config, params = load_hf(str(hf.root / "rm"), mesh=mesh, rules=rules)
    assert config.arch.score_head
    task = reward_task(CENTER)
    program = Program(config, rules, mesh, optimizer=functools.partial(make_optimizer, SETTINGS), task=task,
                      batch_size=PAIRS, seq_len=SEQ, grad_accum=grad_accum)
    data = DataConfig(data=hf.pairs, preference=True, cache_dir=str(hf.root / "cache"))
    train, _ = make_preference_datasets(data, load_tokenizer(str(hf.root / "rm")), SEQ, PAIRS, mesh=mesh, rules=rules)
    batch = next(train.with_rows(train.rows, in_order=True))
    state = program.init(np.zeros(2, np.uint32), params=params)
    _, metrics = program.compiled_train_step()(state, program.place(batch), np.zeros(2, np.uint32))
    return {k: float(v) for k, v in jax.device_get(metrics).items()}, batch, config, params


def trl_reward(hf, batch):
    """TRL's RewardTrainer.compute_loss on the same token rows (its collator pads them) and margins."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(output_dir=str(hf.root / "trl"), report_to=[], per_device_train_batch_size=PAIRS,
                        max_length=None, use_cpu=True, bf16=False, disable_dropout=True,
                        center_rewards_coefficient=CENTER)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = RewardTrainer(model=hf.model, args=args, train_dataset=Dataset.from_list(TEXT_PAIRS),
                                processing_class=hf.tok)
    lengths = batch["segment_ids"].sum(-1)  # [pairs, 2]
    examples = [{"chosen_ids": batch["inputs"][i, 0, : lengths[i, 0]].tolist(),
                 "rejected_ids": batch["inputs"][i, 1, : lengths[i, 1]].tolist(),
                 "margin": float(batch["margin"][i])} for i in range(PAIRS)]
    trainer.model.train()
    trainer._metrics["train"].clear()
    with torch.no_grad():
        value = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    return float(value), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.fixture(scope="module")
def one(hf):
    return ours(hf)


def test_first_step_equals_trl_reward_trainer(hf, one):
    got, batch, _, _ = one
    assert batch["margin"].tolist() == MARGINS  # the data's margin column reached the batch
    want_loss, want = trl_reward(hf, batch)
    assert abs(want["margin"]) > 0.05 and want["max_reward"] - want["min_reward"] > 0.1  # rewards that differ
    assert abs(got["loss"] - want_loss) < 1e-5, (got["loss"], want_loss)
    for name in METRICS:
        assert abs(got[name] - want[name]) < 1e-5 * max(1.0, abs(want[name])), (name, got[name], want[name])


def test_fsdp_tp_on_8_devices_equals_one_device(hf, one):
    eight, _, _, _ = ours(hf, mesh_spec="fsdp=4,tensor=2", rules="fsdp_tp")
    for name in ("loss", *METRICS, "grad_norm"):
        assert abs(eight[name] - one[0][name]) < 1e-5 * max(1.0, abs(one[0][name])), (name, eight[name], one[0][name])


def test_gradient_accumulation_gives_the_whole_batch_step(hf, one):
    """Two microbatches of 2 pairs: the same loss and metrics (min/max over both) and gradient."""
    two, _, _, _ = ours(hf, grad_accum=2)
    for name in ("loss", *METRICS, "grad_norm"):
        assert abs(two[name] - one[0][name]) < 1e-5 * max(1.0, abs(one[0][name])), (name, two[name], one[0][name])


def test_evaluation_totals_keep_the_min_and_max():
    from shardzoo.train.step import merge_sums

    merged = merge_sums({"loss": 1.0, "min_reward": -1.0, "max_reward": 2.0},
                        {"loss": 0.5, "min_reward": -3.0, "max_reward": 1.0})
    assert merged == {"loss": 1.5, "min_reward": -3.0, "max_reward": 2.0}


def test_export_loads_as_llama_for_sequence_classification(hf, one, tmp_path):
    from transformers import AutoModelForSequenceClassification

    _, batch, config, params = one
    export_hf(config, params, str(tmp_path), base={"pad_token_id": 0, "model_type": "llama"})
    back = AutoModelForSequenceClassification.from_pretrained(str(tmp_path)).float().eval()
    assert type(back).__name__ == "LlamaForSequenceClassification" and back.config.num_labels == 1
    lengths = batch["segment_ids"].reshape(-1, SEQ).sum(-1)
    ids = torch.tensor(batch["inputs"].reshape(-1, SEQ)[:, : lengths.max()])
    with torch.no_grad():
        want = back(ids, attention_mask=(ids != 0).long()).logits[:, 0].numpy()
        hf_own = hf.model(ids, attention_mask=(ids != 0).long()).logits[:, 0].numpy()
    assert np.abs(want - hf_own).max() < 1e-4  # the export holds the imported weights
    from shardzoo.train.tasks.reward import sequence_rewards

    scores = jax.jit(config.build().apply)({"params": params}, jax.numpy.asarray(batch["inputs"].reshape(-1, SEQ)))
    got = np.asarray(sequence_rewards(scores, jax.numpy.asarray(batch["segment_ids"].reshape(-1, SEQ))))
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
    assert np.abs(want).max() > 0.1


def test_a_pair_without_chosen_is_one_line_naming_file_row_and_column(hf, tmp_path):
    rows = [dict(r) for r in TEXT_PAIRS]
    rows[2]["chosen"] = None
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    data = DataConfig(data=path, preference=True, cache_dir=str(tmp_path / "cache"))
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    with pytest.raises(UserError) as e:
        make_preference_datasets(data, load_tokenizer(str(hf.root / "rm")), SEQ, PAIRS, mesh=mesh, rules=get_rules("dp"))
    msg = str(e.value)
    assert "\n" not in msg and "bad.jsonl" in msg and "row 3" in msg and "'chosen'" in msg, msg


def test_a_margin_that_is_not_a_number_is_one_line(hf, tmp_path):
    rows = [{**r, "margin": 0.0} for r in TEXT_PAIRS]
    rows[1]["margin"] = "big"
    path = write_jsonl(tmp_path / "badm.jsonl", rows)
    data = DataConfig(data=path, preference=True, cache_dir=str(tmp_path / "cache"))
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    with pytest.raises(UserError) as e:
        make_preference_datasets(data, load_tokenizer(str(hf.root / "rm")), SEQ, PAIRS, mesh=mesh, rules=get_rules("dp"))
    msg = str(e.value)
    assert "\n" not in msg and "badm.jsonl" in msg and "row 2" in msg and "'margin'" in msg, msg


def run_settings(hf, out, **kw):
    from shardzoo.train.config import TrainConfig as Settings

    pairs = write_jsonl(hf.root / "many.jsonl", [{**r, "margin": m} for r, m in zip(TEXT_PAIRS, MARGINS, strict=True)] * 4)
    base = dict(out=str(hf.root / out), init_from=str(hf.root / "rm"), task="reward", data=pairs, batch_size=8,
                seq_len=SEQ, steps=4, lr=1e-2, warmup_steps=0, schedule="constant", log_every=1, save_every=2,
                eval_every=0, center_rewards_coefficient=CENTER)
    return Settings(**{**base, **kw})


def test_a_reward_run_learns_resumes_exactly_and_exports(hf, tmp_path):
    import json

    from transformers import AutoModelForSequenceClassification

    from shardzoo.train.io.hf_io import export_hf as export_run
    from shardzoo.train.launch import DONE, run

    def records(out):
        with open(hf.root / out / "metrics.jsonl") as f:
            return {r["step"]: r for r in map(json.loads, f) if "loss" in r}

    for out, steps in (("straight", 4), ("resumed", 2), ("resumed", 4)):
        result = run(run_settings(hf, out, steps=steps), log=lambda line: None)
        assert result.status == DONE, result.message
    straight, resumed = records("straight"), records("resumed")
    assert straight[4]["loss"] < straight[1]["loss"]  # it learns
    for step in (3, 4):
        for key in ("loss", "accuracy", "margin", "min_reward", "max_reward", "grad_norm"):
            assert resumed[step][key] == straight[step][key], (step, key)
    export_run(str(hf.root / "straight"), str(tmp_path / "hf"))
    back = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf"))
    assert type(back).__name__ == "LlamaForSequenceClassification"


def test_a_reward_run_from_a_causal_lm_keeps_its_body_and_drops_its_head(hf, tmp_path):
    """``--task reward --init-from`` a LlamaForCausalLM dir (as transformers' SequenceClassification of
    it): the body's weights are the LM's, a fresh ``score`` replaces ``lm_head``."""
    from dpo_fixtures import save_llama

    from shardzoo.train.io.lora_io import initial_params
    from shardzoo.train.launch import prepare, with_init_model

    lm = save_llama(tmp_path / "lm", len(hf.tok), seed=0, tokenizer=hf.tok)
    cfg, config, _ = with_init_model(run_settings(hf, "fromlm", init_from=str(tmp_path / "lm")))
    p = prepare(cfg, config)
    assert p.config.arch.score_head
    params = initial_params(p.cfg, p.program.params_target(), p.config, p.mesh, p.rules)
    assert "lm_head" not in params and "score" not in params  # the score head: the program's random init
    state = p.program.init(np.zeros(2, np.uint32), params=params)
    got = np.asarray(jax.device_get(state.params["final_norm"]["scale"]))
    assert np.abs(got - lm.model.norm.weight.detach().numpy()).max() < 1e-6
    assert state.params["score"]["kernel"].shape == (32, 1)



def test_shardzoo_eval_scores_a_reward_model_as_its_first_step(hf, one):
    """``shardzoo eval --task reward`` of the HF reward model over the pairs (one batch, 8 devices): TRL's metrics
    of the first train step (the same params); its loss lacks that step's centering term (>= 0)."""
    from shardzoo.train.evaluate import EvalSettings, format_metrics, run

    got = run(EvalSettings(hf=str(hf.root / "rm"), task="reward", data=hf.pairs, batch_size=PAIRS, seq_len=SEQ,
                           mesh="fsdp=4,tensor=2", rules="fsdp_tp"))
    assert got["task"] == "reward" and got["pairs"] == PAIRS
    for name in METRICS:
        assert abs(got[name] - one[0][name]) < 1e-5 * max(1.0, abs(one[0][name])), (name, got[name], one[0][name])
    assert 0.0 < got["loss"] <= one[0]["loss"] + 1e-6
    assert format_metrics(got).startswith("reward over 4 pairs: loss ")


def test_the_plan_counts_the_score_head_not_an_lm_head():
    from shardzoo.models import get_model

    _, lm = get_model("llama-tiny")
    _, rm = get_model("llama-tiny", score_head=True)
    # the tree's shapes are what is counted: traced, not computed
    params = jax.eval_shape(rm.build().init, jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
    assert "score" in params and "lm_head" not in params
    assert rm.num_params() == sum(x.size for x in jax.tree.leaves(params))
    assert lm.num_params() - rm.num_params() == lm.arch.hidden_size * (lm.arch.vocab_size - 1)
