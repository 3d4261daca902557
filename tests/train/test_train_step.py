"""The pure train step: gradient accumulation, auxiliary losses, masked decay, schedules."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from shardzoo.models import get_model
from shardzoo.sharding import axes as ax
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.config import TrainConfig
from shardzoo.train.optim import decay_mask, make_schedule
from shardzoo.train.program import Program, TrainState
from shardzoo.train.step import train_step
from shardzoo.train.tasks.registry import get_task
from shardzoo.train.trainer import Trainer


def test_grad_accum_of_4_microbatches_equals_one_step_on_the_whole_batch(tiny_lm, fsdp_run, batches,
                                                                         small, tmp_path):
    module, config = tiny_lm
    whole, _, _ = fsdp_run  # its compiled step takes the 32 rows at once
    cfg = TrainConfig(out=str(tmp_path), grad_accum=4, **small)
    accum = Trainer(module, config, cfg, whole.mesh, whole.rules, batches(32, 16))
    batch = next(batches(32, 16, seed=3))
    # Rows weigh differently (about a tenth of the weights are 0), so equal-weight averaging of
    # microbatch means would differ from the whole-batch loss.
    assert len(set(batch["weights"].sum(axis=1).tolist())) > 1
    start = jax.device_get(whole.state)
    out = {}
    for name, trainer in (("whole", whole), ("accum", accum)):
        state = jax.device_put(start, trainer.shardings)  # a fresh copy: the step donates it
        out[name] = jax.device_get(trainer.train_step(state, batch))
    (s1, m1), (s4, m4) = out["whole"], out["accum"]
    assert m1["tokens"] == m4["tokens"] == batch["weights"].sum()
    for key in ("loss", "ce_loss", "grad_norm", "accuracy"):
        np.testing.assert_allclose(m4[key], m1[key], rtol=1e-5, atol=1e-5, err_msg=key)
    assert int(s4.step) == int(s1.step) == int(start.step) + 1
    for a, b in zip(jax.tree.leaves((s4.params, s4.opt_state)), jax.tree.leaves((s1.params, s1.opt_state)),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # and the step did move the params (the comparison is not between two no-ops)
    moved = max(float(np.max(np.abs(a - b))) for a, b in
                zip(jax.tree.leaves(s1.params), jax.tree.leaves(start.params), strict=True))
    assert moved > 1e-4


class ToyMoeLM(nn.Module):
    """Not a zoo model: an embedding, a head, and a sown auxiliary loss and metric."""

    vocab: int = 16

    @nn.compact
    def __call__(self, inputs, positions=None, segment_ids=None, deterministic=True):
        table = self.param("embed", nn.with_logical_partitioning(nn.initializers.normal(1.0), (ax.VOCAB, ax.EMBED)),
                           (self.vocab, 8))
        x = table[inputs]  # [batch, length, embed]
        logits = nn.Dense(self.vocab, name="head")(x)  # [batch, length, vocab]
        self.sow("losses", "router_aux", 0.1 * jnp.mean(jnp.square(x)))
        self.sow("metrics", "dropped_fraction", jnp.float32(0.25))
        return logits


def test_loss_adds_every_sown_auxiliary_loss_and_logs_model_metrics(batches):
    module = ToyMoeLM()
    batch = next(batches(batch_size=4, seq_len=8, vocab=16))
    params = nn.meta.unbox(module.init(jax.random.PRNGKey(0), batch["inputs"])["params"])
    tx = optax.sgd(0.1)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    step = jax.jit(functools.partial(train_step, module=module, task=get_task("lm"), tx=tx,
                                     schedule=lambda s: 0.1))
    _, metrics = step(state, batch, jax.random.PRNGKey(0))

    logits = module.apply({"params": params}, batch["inputs"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    expected_ce = float((ce * batch["weights"]).sum() / batch["weights"].sum())
    x = params["embed"][batch["inputs"]]
    expected_aux = float(0.1 * jnp.mean(jnp.square(x)))
    np.testing.assert_allclose(metrics["ce_loss"], expected_ce, rtol=1e-5)
    np.testing.assert_allclose(metrics["aux_loss"], expected_aux, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], expected_ce + expected_aux, rtol=1e-5)
    assert float(metrics["dropped_fraction"]) == 0.25


def test_weight_decay_mask_takes_kernels_and_embeddings_not_norms_or_biases():
    module, config = get_model("gpt2-tiny", num_hidden_layers=1)
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    boxed = Program(config, get_rules("dp"), mesh).boxed_params
    mask = {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(decay_mask(boxed))[0]}
    decayed = {p for p, v in mask.items() if v}
    assert decayed == {
        "embed/embedding", "pos_embed/embedding", "layers/attn/q/kernel", "layers/attn/k/kernel",
        "layers/attn/v/kernel", "layers/attn/o/kernel", "layers/mlp/up/kernel", "layers/mlp/down/kernel",
    }, decayed
    # scanned norms are [layers, embed] and q biases [layers, heads, head_dim]: not decayed
    assert not mask["layers/attn_norm/scale"] and not mask["layers/attn/q/bias"]
    assert not mask["final_norm/bias"]


def test_schedules_warm_up_then_decay():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, steps=110, schedule="cosine")
    cosine = make_schedule(cfg)
    assert float(cosine(0)) == 0.0 and abs(float(cosine(5)) - 0.5) < 1e-6
    assert abs(float(cosine(10)) - 1.0) < 1e-6 and abs(float(cosine(110)) - 0.1) < 1e-6
    linear = make_schedule(TrainConfig(lr=1.0, warmup_steps=10, steps=110, schedule="linear"))
    assert abs(float(linear(60)) - 0.5) < 1e-6 and abs(float(linear(110))) < 1e-6
    constant = make_schedule(TrainConfig(lr=1.0, warmup_steps=0, steps=110, schedule="constant"))
    assert float(constant(0)) == float(constant(100)) == 1.0
