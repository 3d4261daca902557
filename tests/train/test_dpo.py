"""DPO and its variants equal TRL on the same tiny models and pairs (fp32): the first step's loss and
its rewards/* and logps/* metrics, for each --loss, with a reference model that is NOT the policy;
under fsdp_tp on 8 devices the same as on one; LoRA DPO's reference costs no parameter bytes."""

import functools
import os
import sys
import types
import warnings

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from dpo_fixtures import TEXT_PAIRS, save_llama, save_tokenizer, write_jsonl  # noqa: E402

from shardzoo.data import DataConfig, load_tokenizer  # noqa: E402
from shardzoo.data.loader import make_preference_datasets  # noqa: E402
from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.train.config import TrainConfig  # noqa: E402
from shardzoo.train.io.hf_io import load_hf  # noqa: E402
from shardzoo.train.optim import make_optimizer  # noqa: E402
from shardzoo.train.program import Program  # noqa: E402
from shardzoo.train.tasks.preference import preference_task  # noqa: E402

BETA, SEQ, PAIRS = 0.1, 40, 4
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
SETTINGS = TrainConfig(batch_size=PAIRS, seq_len=SEQ, lr=1e-3, warmup_steps=0, schedule="constant")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Tokenizer, a policy and a different reference (both saved), and the pairs file."""
    root = tmp_path_factory.mktemp("dpo")
    tok = save_tokenizer(root / "tok")
    policy = save_llama(root / "policy", len(tok), seed=0, tokenizer=tok)
    reference = save_llama(root / "reference", len(tok), seed=1, tokenizer=tok)
    return types.SimpleNamespace(root=root, tok=tok, policy=policy, reference=reference,
                                 pairs=write_jsonl(root / "pairs.jsonl", TEXT_PAIRS))


_TRL = {}


def trl_dpo(hf, loss, weights=None, **settings):
    """TRL's DPOTrainer on the pairs: ``(loss, metrics, tokenized pairs)`` of its first batch with
    ``loss_type`` the comma-separated ``loss`` and the other DPOConfig ``settings``. One trainer
    per session, its loss settings set on it before each call (they are read at each step)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    if id(hf) not in _TRL:
        args = DPOConfig(output_dir=str(hf.root / "trl"), beta=BETA, loss_type=["sigmoid"], report_to=[],
                         per_device_train_batch_size=PAIRS, max_length=None, use_cpu=True, bf16=False,
                         disable_dropout=True, use_weighting=True)  # its head also gives WPO's log sum p^2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _TRL[id(hf)] = DPOTrainer(model=hf.policy, ref_model=hf.reference, args=args,
                                      train_dataset=Dataset.from_list(TEXT_PAIRS), processing_class=hf.tok)
    trainer = _TRL[id(hf)]
    losses = loss.split(",")
    trainer.loss_types, trainer.loss_weights = losses, list(weights or [1.0] * len(losses))
    trainer.label_smoothing = settings.get("label_smoothing", 0.0)
    trainer.ld_alpha = settings.get("ld_alpha")
    trainer.use_weighting = settings.get("use_weighting", False)
    trainer.f_divergence_type = settings.get("f_divergence_type", "reverse_kl")
    trainer.f_alpha_divergence_coef = settings.get("f_alpha_divergence_coef", 0.5)
    trainer.args.discopop_tau = settings.get("discopop_tau", 0.05)
    examples = [trainer.train_dataset[i] for i in range(PAIRS)]
    trainer.model.train()
    trainer._metrics["train"].clear()
    with torch.no_grad():
        value = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(value), metrics, examples


def trl_reference_free(hf, loss, examples):
    """TRL's CPOTrainer (simpo) / ORPOTrainer (orpo) loss code on the policy's log-probs, computed
    by TRL's ``get_batch_logps`` on transformers' logits of the same tokens."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    rows, labels = [], []
    for which in ("chosen_ids", "rejected_ids"):
        for ex in examples:
            rows.append(ex["prompt_ids"] + ex[which])
            labels.append([-100] * len(ex["prompt_ids"]) + ex[which])
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    with torch.no_grad():
        logits = hf.policy(ids, attention_mask=(lab != -100) | (torch.arange(width) < torch.tensor(
            [len(r) for r in rows])[:, None])).logits.float()
    logps = CPOTrainer.get_batch_logps(logits, lab, average_log_prob=True)
    chosen, rejected = logps[:PAIRS], logps[PAIRS:]
    nll = F.cross_entropy(logits[:PAIRS, :-1].reshape(-1, logits.shape[-1]), lab[:PAIRS, 1:].reshape(-1))
    stub = types.SimpleNamespace(beta=BETA, alpha=0.0, loss_type=loss, simpo_gamma=0.5, label_smoothing=0.0,
                                 accelerator=types.SimpleNamespace(device="cpu"))
    if loss == "simpo":
        losses, cr, rr = CPOTrainer.cpo_loss(stub, chosen, rejected)
        value = losses.mean() + 1.0 * nll  # cpo_alpha 1.0, TRL's default
    else:
        losses, cr, rr, _, _ = ORPOTrainer.odds_ratio_loss(stub, chosen, rejected)
        value = nll - losses.mean()
    metrics = {"rewards/chosen": cr.mean(), "rewards/rejected": rr.mean(),
               "rewards/accuracies": (cr > rr).float().mean(), "rewards/margins": (cr - rr).mean(),
               "logps/chosen": chosen.mean(), "logps/rejected": rejected.mean()}
    return float(value), {k: float(v) for k, v in metrics.items()}


_RESULTS = {}


def ours(hf, loss, mesh_spec="data=1", rules="dp", grad_accum=1, **task):
    """shardzoo's first train step: ``(metrics, batch)``, the reference's log-probs from the
    reference model's own checkpoint (a frozen copy); each setting computed once per session."""
    key = (id(hf), loss, mesh_spec, rules, grad_accum, tuple(sorted(task.items())))
    if key not in _RESULTS:
        _RESULTS[key] = _ours(hf, loss, mesh_spec, rules, grad_accum, **task)
    return _RESULTS[key]


def _ours(hf, loss, mesh_spec, rules, grad_accum, **task):
    devices = jax.devices()[:1] if mesh_spec == "data=1" else jax.devices()
    mesh, rules = make_mesh(mesh_spec, devices=devices), get_rules(rules)
    _, config, params = load_hf(str(hf.root / "policy"), mesh=mesh, rules=rules)
    _, _, ref_params = load_hf(str(hf.root / "reference"), mesh=mesh, rules=rules)
    task = preference_task(loss, beta=BETA, **task)
    program = Program(config, rules, mesh, optimizer=functools.partial(make_optimizer, SETTINGS), task=task,
                      batch_size=PAIRS, seq_len=SEQ, grad_accum=grad_accum,
                      reference="copy" if task.uses_reference else None)
    tokenizer = load_tokenizer(str(hf.root / "policy"))
    data = DataConfig(data=hf.pairs, preference=True, cache_dir=str(hf.root / "cache"))
    train, _ = make_preference_datasets(data, tokenizer, SEQ, PAIRS, mesh=mesh, rules=rules)
    batch = next(train.with_rows(train.rows, in_order=True))
    placed = program.place(batch)
    if task.uses_reference:
        placed.update(program.compiled_reference_step()(ref_params, placed))
    state = program.init(np.zeros(2, np.uint32), params=params)
    _, metrics = program.compiled_train_step()(state, placed, np.zeros(2, np.uint32))
    return {k: float(v) for k, v in jax.device_get(metrics).items()}, batch


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge"])
def test_each_dpo_loss_equals_trl_dpotrainer_on_its_first_step(hf, loss):
    want_loss, want, examples = trl_dpo(hf, loss)
    got, batch = ours(hf, loss)
    # the tokens that score are TRL's: each completion (with its eos) after the prompt
    for i, ex in enumerate(examples):
        for j, which in enumerate(("chosen_ids", "rejected_ids")):
            scored = batch["targets"][i, j][batch["loss_mask"][i, j] > 0].tolist()
            assert scored == ex[which]
            assert batch["inputs"][i, j, : len(ex["prompt_ids"])].tolist() == ex["prompt_ids"]
    assert abs(want["rewards/margins"]) > 0.05  # a reference unlike the policy: the rewards are not 0
    assert abs(got["loss"] - want_loss) < 1e-5, (got["loss"], want_loss)
    for name in METRICS:
        assert abs(got[name] - want[name]) < 1e-5 * max(1.0, abs(want[name])), (name, got[name], want[name])


def test_a_wpo_train_step_equals_trl_dpotrainer(hf):
    """``use_weighting``: the step reads the whole logits (no tiled head) for WPO's weights."""
    want_loss, want, _ = trl_dpo(hf, "sigmoid", use_weighting=True)
    got, _ = ours(hf, "sigmoid", use_weighting=True)
    assert abs(want_loss - trl_dpo(hf, "sigmoid")[0]) > 1e-3  # the weights change the loss
    assert abs(got["loss"] - want_loss) < 1e-5, (got["loss"], want_loss)
    for name in METRICS:
        assert abs(got[name] - want[name]) < 1e-5 * max(1.0, abs(want[name])), (name, got[name], want[name])


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_equal_trl_cpo_and_orpo_code(hf, loss):
    _, _, examples = trl_dpo(hf, "sigmoid")
    want_loss, want = trl_reference_free(hf, loss, examples)
    got, _ = ours(hf, loss, **({"cpo_alpha": 1.0} if loss == "simpo" else {}))
    assert abs(got["loss"] - want_loss) < 1e-5, (got["loss"], want_loss)
    for name in METRICS:
        assert abs(got[name] - want[name]) < 1e-5, (name, got[name], want[name])
    assert got["nll_loss"] > 0


def test_label_smoothing_is_conservative_dpo(hf):
    """With ls: mean(-(1 - ls) logsig(z) - ls logsig(-z)), z = beta * d per pair. Since
    -logsig(-z) = -logsig(z) + z, that is the unsmoothed loss plus ls * mean(z), and mean(z) is the
    rewards/margins metric: exact, whatever the pairs."""
    plain, _ = ours(hf, "sigmoid")
    smooth, _ = ours(hf, "sigmoid", label_smoothing=0.2)
    assert smooth["rewards/margins"] == pytest.approx(plain["rewards/margins"], abs=1e-6)  # the same z
    assert abs(plain["rewards/margins"]) > 0.05
    assert smooth["loss"] == pytest.approx(plain["loss"] + 0.2 * plain["rewards/margins"], abs=1e-6)


@pytest.mark.parametrize("loss,settings", [("sigmoid", {}), ("orpo", {}),
                                           ("aot,sft", {"loss_weights": (1.0, 0.5), "ld_alpha": 0.5})])
def test_fsdp_tp_on_8_devices_equals_one_device(hf, loss, settings):
    """The same step on 8 devices; aot sorts over the whole (sharded) batch, LD-DPO's weights
    count the pair's tokens along the sharded length."""
    one, _ = ours(hf, loss, **settings)
    eight, _ = ours(hf, loss, mesh_spec="fsdp=4,tensor=2", rules="fsdp_tp", **settings)
    for name in ("loss", *METRICS, "grad_norm"):
        assert abs(eight[name] - one[name]) < 1e-5 * max(1.0, abs(one[name])), (name, eight[name], one[name])


def test_gradient_accumulation_gives_the_whole_batch_step(hf):
    """Two microbatches of 2 pairs: the same loss, metrics and gradient as one batch of 4, the
    ORPO NLL included (it divides by the chosen tokens of the whole step, as TRL's batch mean)."""
    one, _ = ours(hf, "orpo")
    two, _ = ours(hf, "orpo", grad_accum=2)
    for name in ("loss", "nll_loss", *METRICS, "grad_norm"):
        assert abs(two[name] - one[name]) < 1e-5 * max(1.0, abs(one[name])), (name, two[name], one[name])


# Every loss TRL 1.16's DPOConfig.loss_type lists, their MPO combination, LD-DPO and the f-DPO
# regularizers, each with the hyperparameters that change it (label smoothing where it enters).
CASES = {
    "sigmoid": ("sigmoid", None, {}),
    "hinge": ("hinge", None, {}),
    "ipo": ("ipo", None, {}),
    "exo_pair": ("exo_pair", None, {"label_smoothing": 1e-3}),
    "nca_pair": ("nca_pair", None, {}),
    "robust": ("robust", None, {"label_smoothing": 0.1}),
    "bco_pair": ("bco_pair", None, {}),
    "sppo_hard": ("sppo_hard", None, {}),
    "aot": ("aot", None, {"label_smoothing": 0.1}),
    "aot_unpaired": ("aot_unpaired", None, {"label_smoothing": 0.1}),
    "apo_zero": ("apo_zero", None, {}),
    "apo_down": ("apo_down", None, {}),
    "discopop": ("discopop", None, {"discopop_tau": 0.3}),
    "sft": ("sft", None, {}),
    "sigmoid_norm": ("sigmoid_norm", None, {}),
    "mpo": ("sigmoid,bco_pair,sft", (0.8, 0.2, 1.0), {}),
    "ld_alpha": ("sigmoid,sft", (0.8, 0.2), {"ld_alpha": 0.3}),
    "forward_kl": ("sigmoid", None, {"f_divergence_type": "forward_kl"}),
    "js_divergence": ("ipo", None, {"f_divergence_type": "js_divergence"}),
    "alpha_divergence": ("robust,discopop", None, {"f_divergence_type": "alpha_divergence",
                                                   "f_alpha_divergence_coef": 0.3, "label_smoothing": 0.1}),
    "wpo": ("sigmoid", None, {"use_weighting": True}),
    # (TRL 1.16's WPO raises with "sft": it weights an expanded tensor in place)
    "wpo_mpo_ld_alpha": ("sigmoid,bco_pair", (0.8, 0.2), {"use_weighting": True, "ld_alpha": 0.3}),
}


@pytest.fixture(scope="module")
def logits(hf):
    """The policy's and the reference's logits on the first batch (one forward each), and the
    placed batch: each loss below is the task's sums on them, as the train step computes them."""
    from shardzoo.train.tasks.base import forward

    mesh, rules = make_mesh("data=1", devices=jax.devices()[:1]), get_rules("dp")
    _, config, params = load_hf(str(hf.root / "policy"), mesh=mesh, rules=rules)
    _, _, ref_params = load_hf(str(hf.root / "reference"), mesh=mesh, rules=rules)
    program = Program(config, rules, mesh, task=preference_task("sigmoid"), batch_size=PAIRS, seq_len=SEQ,
                      reference="copy")
    data = DataConfig(data=hf.pairs, preference=True, cache_dir=str(hf.root / "cache"))
    train, _ = make_preference_datasets(data, load_tokenizer(str(hf.root / "policy")), SEQ, PAIRS, mesh=mesh,
                                        rules=rules)
    placed = program.place(next(train.with_rows(train.rows, in_order=True)))
    run = jax.jit(lambda p, b: forward(program.task, program.module, p, b, jax.random.PRNGKey(0), True)[0])
    return run(params, placed), run(ref_params, placed), placed


@pytest.mark.parametrize("case", list(CASES))
def test_every_trl_dpo_loss_equals_trl_on_the_first_batch(hf, logits, case):
    """Loss and the rewards/* and logps/* metrics within 1e-5 of TRL's DPOTrainer (fp32)."""
    loss, weights, settings = CASES[case]
    want_loss, want, _ = trl_dpo(hf, loss, weights, **settings)
    policy, reference, placed = logits
    task = preference_task(loss, beta=BETA, loss_weights=weights, **settings)
    batch = {**placed, "ref_logps": task.reference_logps(reference, placed)}
    sums = jax.device_get(jax.jit(task.sums)(policy, batch))
    got = {k: float(v) for k, v in task.extra_metrics(sums, sums["weight"]).items()}
    got["loss"] = float(sums["loss"] / sums["weight"])
    assert abs(want["rewards/margins"]) > 0.05 and abs(want_loss) > 1e-3
    if settings.get("use_weighting"):  # the weights are not 1: WPO changes the loss
        assert abs(want_loss - trl_dpo(hf, loss, weights, **{**settings, "use_weighting": False})[0]) > 1e-3
    assert abs(got["loss"] - want_loss) < 1e-5 * max(1.0, abs(want_loss)), (got["loss"], want_loss)
    for name in METRICS:
        assert abs(got[name] - want[name]) < 1e-5 * max(1.0, abs(want[name])), (name, got[name], want[name])
    _DIFFS[case] = {"loss": abs(got["loss"] - want_loss), **{n: abs(got[n] - want[n]) for n in METRICS}}


_DIFFS = {}


@pytest.mark.parametrize("settings,words", [
    ({"loss": "sigmoid,foo"}, "--loss 'foo'"),
    ({"loss": "sigmoid,sft", "loss_weights": (1.0,)}, "--loss-weights has 1 values for 2"),
    ({"loss": "exo_pair"}, "--label-smoothing > 0"),
    ({"loss": "bco_pair", "f_divergence_type": "js_divergence"}, "goes only with --loss"),
    ({"loss": "sigmoid", "ld_alpha": 1.5}, "--ld-alpha must be in [0, 1]"),
    ({"loss": "sigmoid,orpo"}, "do not combine"),
    ({"loss": "aot", "use_weighting": True}, "--use-weighting does not go with --loss aot"),
])
def test_bad_loss_settings_are_one_line_errors(settings, words):
    from shardzoo.errors import UserError

    with pytest.raises(UserError) as e:
        preference_task(**settings)
    assert words in str(e.value) and "\n" not in str(e.value)
