"""The Trainer under other rule tables: resharding on resume, ZeRO-1, and the eval loop."""

import math
import shutil

import jax
import numpy as np
import optax

from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.config import TrainConfig
from shardzoo.train.io.sources import init_params_from
from shardzoo.train.trainer import Trainer


def _losses(history, steps):
    by_step = {r["step"]: r["loss"] for r in history if "loss" in r}
    return [by_step[s] for s in steps]


def test_resume_under_tp_on_another_mesh_continues_the_fsdp_run(tiny_lm, fsdp_run, batches, small, tmp_path):
    module, config = tiny_lm
    _, uninterrupted, fsdp_out = fsdp_run
    # A run killed while saving step 8 under fsdp on fsdp=8: its out dir holds the checkpoint of
    # step 4 and the unfinished orbax tmp dir of step 8, which must not be picked up.
    shutil.copytree(fsdp_out / "checkpoints" / "4", tmp_path / "checkpoints" / "4")
    shutil.copytree(fsdp_out / "checkpoints" / "8", tmp_path / "checkpoints" / "8.orbax-checkpoint-tmp-1765")
    cfg = TrainConfig(out=str(tmp_path), save_every=4, **small)
    tp = Trainer(module, config, cfg, make_mesh("data=2,tensor=4"), get_rules("tp"), batches(32, 16),
                 meta={"model": "llama-tiny"})
    assert tp.start_step == 4
    q = tp.state.params["layers"]["attn"]["q"]["kernel"]  # [layers, embed, heads, head_dim]
    assert q.sharding.spec[2] == "tensor" and q.addressable_shards[0].data.shape[2] == 1
    resumed = tp.fit()
    assert [r["step"] for r in resumed if "loss" in r] == [5, 6, 7, 8]
    np.testing.assert_allclose(_losses(resumed, [5, 6, 7, 8]), _losses(uninterrupted, [5, 6, 7, 8]),
                               rtol=1e-5, atol=1e-5)


def _adam_moments(opt_state):
    """The leaves of mu and nu of the adamw state inside the optax chain."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    assert len(found) == 1
    return jax.tree.leaves((found[0].mu, found[0].nu))


def test_zero1_gives_the_same_losses_with_optimizer_state_split_over_data(tiny_lm, fsdp_run, batches, small, tmp_path):
    module, config = tiny_lm
    _, reference, _ = fsdp_run  # the same model, data and seed under fsdp: the losses of any layout
    cfg = TrainConfig(out=str(tmp_path), save_every=0, **small)
    z1 = Trainer(module, config, cfg, make_mesh("data=8"), get_rules("dp"), batches(32, 16),
                 opt_rules=get_rules("zero1"), meta={"model": "llama-tiny"})
    history = z1.fit(stop_after=3)
    np.testing.assert_allclose(_losses(history, [1, 2, 3]), _losses(reference, [1, 2, 3]), rtol=1e-5, atol=1e-5)
    # params are replicated (dp); every Adam moment is split 8 ways over data
    for p in jax.tree.leaves(z1.state.params):
        assert p.addressable_shards[0].data.shape == p.shape
    moments = _adam_moments(z1.state.opt_state)
    for m in moments:
        assert m.addressable_shards[0].data.size * 8 == m.size, m.sharding
    full = sum(m.nbytes for m in moments)  # what one device holds of them under dp
    assert sum(m.addressable_shards[0].data.nbytes for m in moments) * 8 == full


def test_eval_reports_loss_perplexity_and_accuracy_of_the_held_out_batches(tiny_lm, fsdp_run, batches, small):
    module, _ = tiny_lm
    trainer, history, _ = fsdp_run
    got = trainer.evaluate()
    assert {k: v for k, v in history[-1].items() if k.startswith("eval_")} == got  # logged at the end
    params = jax.device_get(trainer.state.params)
    held_out = batches(32, 16, seed=9)
    forward = jax.jit(lambda p, x: module.apply({"params": p}, x))  # one device, no sharding
    loss_sum = weight_sum = correct = 0.0
    for _ in range(small["eval_steps"]):
        b = next(held_out)
        logits = np.asarray(forward(params, b["inputs"]), np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, b["targets"][..., None], -1)[..., 0]
        loss_sum += (nll * b["weights"]).sum()
        weight_sum += b["weights"].sum()
        correct += ((logits.argmax(-1) == b["targets"]) * b["weights"]).sum()
    np.testing.assert_allclose(got["eval_loss"], loss_sum / weight_sum, rtol=1e-5)
    np.testing.assert_allclose(got["eval_perplexity"], math.exp(loss_sum / weight_sum), rtol=1e-5)
    np.testing.assert_allclose(got["eval_accuracy"], correct / weight_sum, rtol=1e-6)
    assert trainer.evaluate() == got  # the same held-out batches every time


def test_init_from_a_run_loads_its_params_onto_another_mesh_with_a_fresh_optimizer(
        tiny_lm, fsdp_run, batches, small, tmp_path):
    module, config = tiny_lm
    source, _, source_out = fsdp_run
    mesh, rules = make_mesh("data=2,tensor=4"), get_rules("tp")
    cfg = TrainConfig(out=str(tmp_path), init_from=str(source_out), **small)
    trainer = Trainer(module, config, cfg, mesh, rules, batches(32, 16), meta={"model": "llama-tiny"},
                      init_params=lambda target: init_params_from(str(source_out), target, config, mesh, rules))
    assert trainer.start_step == 0 and int(trainer.state.step) == 0
    for a, b in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(source.state.params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert all(not np.asarray(m).any() for m in _adam_moments(trainer.state.opt_state))
