"""KTO (``--task kto``) equals TRL's KTOTrainer on the same tiny policy, a different reference and
the same unpaired rows (fp32): the first step's loss and every metric TRL logs for the loss
(``kl``, ``rewards/*``, ``logps/*``), for both loss types; under fsdp_tp on 8 devices the same as
on one; bad rows are one line naming file, row and column; runs resume exactly and evaluate."""

import functools
import json
import os
import sys
import types
import warnings

import jax
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from dpo_fixtures import TEXT_PAIRS, save_llama, save_tokenizer, write_jsonl  # noqa: E402

from shardzoo.data import DataConfig, load_tokenizer  # noqa: E402
from shardzoo.data.errors import DataError  # noqa: E402
from shardzoo.data.loader import make_preference_datasets  # noqa: E402
from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.train.config import TrainConfig  # noqa: E402
from shardzoo.train.io.hf_io import load_hf  # noqa: E402
from shardzoo.train.launch import DONE, run  # noqa: E402
from shardzoo.train.optim import make_optimizer  # noqa: E402
from shardzoo.train.program import Program  # noqa: E402
from shardzoo.train.tasks.kto import kto_task  # noqa: E402

BETA, SEQ, ROWS = 0.1, 40, 4
WEIGHTS = {"desirable_weight": 1.3, "undesirable_weight": 0.7}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
# unpaired rows from the pairs: desirable and undesirable completions mixed in each batch
KTO_ROWS = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for i, p in enumerate(TEXT_PAIRS) for side in (("chosen", "rejected") if i % 2 else ("rejected", "chosen"))]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("kto")
    tok = save_tokenizer(root / "tok")
    policy = save_llama(root / "policy", len(tok), seed=1, tokenizer=tok)
    reference = save_llama(root / "reference", len(tok), seed=0, tokenizer=tok)  # a KL estimate > 0
    return types.SimpleNamespace(root=root, tok=tok, policy=policy, reference=reference,
                                 rows=write_jsonl(root / "rows.jsonl", KTO_ROWS),
                                 more=write_jsonl(root / "more.jsonl", KTO_ROWS * 2))


_TRL = {}


def trl_kto(hf, loss):
    """TRL's KTOTrainer on the rows: ``(loss, metrics, examples)`` of its first batch (one trainer,
    its loss type set before each call)."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    if id(hf) not in _TRL:
        args = KTOConfig(output_dir=str(hf.root / "trl"), beta=BETA, loss_type="kto", report_to=[],
                         per_device_train_batch_size=ROWS, max_length=None, use_cpu=True, bf16=False,
                         disable_dropout=True, **WEIGHTS)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _TRL[id(hf)] = KTOTrainer(model=hf.policy, ref_model=hf.reference, args=args,
                                      train_dataset=Dataset.from_list(KTO_ROWS), processing_class=hf.tok)
    trainer = _TRL[id(hf)]
    trainer.loss_type, trainer.calculate_KL = loss, loss == "kto"  # as its __init__ sets them
    examples = [trainer.train_dataset[i] for i in range(ROWS)]
    trainer.model.train()
    trainer._metrics["train"].clear()
    with torch.no_grad():
        value = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    return float(value), {k: v[-1] for k, v in trainer._metrics["train"].items()}, examples


_OURS = {}


def ours(hf, loss, mesh_spec="data=1", rules="dp"):
    """shardzoo's first train step on the rows in order: ``(metrics, batch)``."""
    key = (id(hf), loss, mesh_spec)
    if key in _OURS:
        return _OURS[key]
    devices = jax.devices()[:1] if mesh_spec == "data=1" else jax.devices()
    mesh, rules = make_mesh(mesh_spec, devices=devices), get_rules(rules)
    _, config, params = load_hf(str(hf.root / "policy"), mesh=mesh, rules=rules)
    _, _, ref_params = load_hf(str(hf.root / "reference"), mesh=mesh, rules=rules)
    task = kto_task(loss, beta=BETA, **WEIGHTS)
    settings = TrainConfig(batch_size=ROWS, seq_len=SEQ, lr=1e-3, warmup_steps=0, schedule="constant")
    program = Program(config, rules, mesh, optimizer=functools.partial(make_optimizer, settings), task=task,
                      batch_size=ROWS, seq_len=SEQ, reference="copy")
    data = DataConfig(data=hf.rows, preference=True, unpaired=True, cache_dir=str(hf.root / "cache"))
    train, _ = make_preference_datasets(data, load_tokenizer(str(hf.root / "policy")), SEQ, ROWS, mesh=mesh,
                                        rules=rules)
    batch = next(train.with_rows(train.rows, in_order=True))
    placed = program.place(batch)
    placed.update(program.compiled_reference_step()(ref_params, placed))
    state = program.init(np.zeros(2, np.uint32), params=params)
    _, metrics = program.compiled_train_step()(state, placed, np.zeros(2, np.uint32))
    _OURS[key] = {k: float(v) for k, v in jax.device_get(metrics).items()}, batch
    return _OURS[key]


_DIFFS = {}


@pytest.mark.parametrize("loss", ["kto", "apo_zero_unpaired"])
def test_kto_equals_trl_ktotrainer_on_its_first_step(hf, loss):
    want_loss, want, examples = trl_kto(hf, loss)
    got, batch = ours(hf, loss)
    # the tokens that score are TRL's: the completion, and the KL row's: the previous row's completion
    for i, ex in enumerate(examples):
        for j, which in enumerate(("completion_ids", "KL_completion_ids")):
            assert batch["targets"][i, j][batch["loss_mask"][i, j] > 0].tolist() == ex[which]
            assert batch["inputs"][i, j, : len(ex["prompt_ids"])].tolist() == ex["prompt_ids"]
        assert batch["labels"][i] == float(ex["label"])
    # a reference unlike the policy: rewards and the KL estimate are not 0 (nor clamped to 0)
    assert min(abs(want["rewards/chosen"]), abs(want["rewards/rejected"])) > 0.05
    assert want["kl"] > 0.5 if loss == "kto" else want["kl"] == 0.0
    assert abs(got["loss"] - want_loss) < 1e-5, (got["loss"], want_loss)
    for name in METRICS:
        assert abs(got[name] - want[name]) < 1e-5 * max(1.0, abs(want[name])), (name, got[name], want[name])
    _DIFFS[loss] = {"loss": abs(got["loss"] - want_loss), **{n: abs(got[n] - want[n]) for n in METRICS}}


def test_kto_fsdp_tp_on_8_devices_equals_one_device(hf):
    """The KL estimate is a mean over the whole (sharded) batch."""
    one, _ = ours(hf, "kto")
    eight, _ = ours(hf, "kto", mesh_spec="fsdp=4,tensor=2", rules="fsdp_tp")
    for name in ("loss", *METRICS, "grad_norm"):
        assert abs(eight[name] - one[name]) < 1e-5 * max(1.0, abs(one[name])), (name, eight[name], one[name])


def test_a_label_that_is_not_a_bool_is_one_line_naming_file_row_and_column(hf, tmp_path):
    rows = [dict(r) for r in KTO_ROWS]
    rows[2]["label"] = "yes"
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    data = DataConfig(data=path, preference=True, unpaired=True, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError) as e:
        make_preference_datasets(data, load_tokenizer(str(hf.root / "policy")), SEQ, ROWS)
    message = str(e.value)
    assert "\n" not in message and path in message and "row 3" in message and "column 'label'" in message


def settings(hf, out, **kw):
    """A run on the 8 devices: 8 rows a step."""
    base = dict(out=str(hf.root / out), init_from=str(hf.root / "policy"), reference=str(hf.root / "reference"),
                task="kto", data=hf.more, batch_size=8, seq_len=SEQ, steps=4, lr=1e-2, warmup_steps=0,
                schedule="constant", log_every=1, save_every=2, eval_every=0, **WEIGHTS)
    return TrainConfig(**{**base, **kw})


def records(hf, out):
    with open(hf.root / out / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f)]


def quiet(cfg):
    result = run(cfg, log=lambda line: None)
    assert result.status == DONE, result.message


@pytest.fixture(scope="module")
def straight(hf):
    quiet(settings(hf, "straight"))
    return {r["step"]: r for r in records(hf, "straight") if "loss" in r}


def test_a_resumed_kto_run_equals_the_uninterrupted_one(hf, straight):
    quiet(settings(hf, "resumed", steps=2))
    quiet(settings(hf, "resumed"))
    resumed = {r["step"]: r for r in records(hf, "resumed") if "loss" in r}
    for step in (3, 4):
        for key in ("loss", "kl", "rewards/chosen", "rewards/margins", "logps/rejected", "grad_norm"):
            assert resumed[step][key] == straight[step][key], (step, key)
    assert straight[4]["loss"] < straight[1]["loss"]  # it learns


def test_precomputed_reference_gives_the_same_first_step(hf, straight):
    """The reference log-probs of each row and of its KL row, stored with the run."""
    quiet(settings(hf, "pre", precompute_reference=True, steps=1))
    assert (hf.root / "pre" / "reference_logps.npy").exists()
    first = {r["step"]: r for r in records(hf, "pre") if "loss" in r}[1]
    for key in ("loss", *METRICS):
        assert first[key] == pytest.approx(straight[1][key], abs=1e-5), key


def test_eval_of_a_kto_run_equals_its_final_held_out_metrics(hf):
    from shardzoo.train import evaluate

    quiet(settings(hf, "held", steps=2, eval_fraction=0.5))
    final = [r for r in records(hf, "held") if "eval_loss" in r][-1]
    metrics = evaluate.run(evaluate.EvalSettings(checkpoint=str(hf.root / "held"), split="eval"))
    assert metrics["task"] == "kto" and metrics["examples"] == 8 and metrics["reference"] == "frozen copy"
    for key in ("loss", *METRICS):
        assert metrics[key] == pytest.approx(final[f"eval_{key}"], abs=1e-5), key
    assert evaluate.format_metrics(metrics).startswith("kto (kto, beta 0.1, reference: frozen copy) over 8 examples")
