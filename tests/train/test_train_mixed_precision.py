"""Mixed precision: bfloat16 compute with float32 parameters trains, and every array keeps the
dtype it should (parameters, gradients and optimizer state float32; logits bfloat16)."""


import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.config import TrainConfig
from shardzoo.train.trainer import Trainer


def _floats(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def test_bfloat16_compute_with_float32_params_trains_3_steps(tiny_lm, batches, small, tmp_path):
    _, config = tiny_lm
    config = config.replace(dtype="bfloat16", param_dtype="float32")
    module = config.build()
    cfg = TrainConfig(out=str(tmp_path), **{**small, "steps": 3, "warmup_steps": 1})
    trainer = Trainer(module, config, cfg, make_mesh("fsdp=8"), get_rules("fsdp"), batches(32, 16))
    losses = [r["loss"] for r in trainer.fit() if "loss" in r]
    assert len(losses) == 3 and np.isfinite(losses).all() and losses[-1] < losses[0], losses

    params = jax.device_get(trainer.state.params)
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float32)}
    moments = _floats(trainer.state.opt_state)  # adamw's mu and nu mirror every parameter
    assert len(moments) >= 2 * len(jax.tree.leaves(params))
    assert {x.dtype for x in moments} == {np.dtype(np.float32)}

    batch = next(batches(32, 16, seed=5))
    inputs = (batch["inputs"], batch["positions"], batch["segment_ids"])

    def loss(p):
        logits = module.apply({"params": p}, *inputs)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["targets"]).mean(), logits

    # one jitted program for the logits, the loss and its gradient: cheaper than the model's ops one by one
    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert logits.dtype == jnp.bfloat16 and logits.shape == (32, 16, config.vocab_size)
    assert {x.dtype for x in jax.tree.leaves(grads)} == {np.dtype(np.float32)}
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert np.isfinite(float(value))
