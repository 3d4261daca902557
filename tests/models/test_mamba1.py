"""Mamba1's selective-scan mixer (models/mamba1.py): the chunked scan equals the token-by-token
recurrence, outputs, final states and gradients (1e-5), for lengths that are and are not
multiples of the chunk, with packed segments and an initial state; a whole model's (a mamba1 and an
attention layer) logits and gradients equal with its mamba1 layer run by the recurrence; context parallelism (the states
passed along the ring by collective-permutes) equals one device (1e-5), the sequence never
gathered in a mamba1 layer; the plan within 15% of the compiled step; the decoding cache counted. fp32.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from shardzoo.models import get_model, mamba1
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import Placement, activate, logical_shardings
from shardzoo.train.jit import count_collectives

sys.path.insert(0, os.path.dirname(__file__))
from mixer_checks import FAST, length_gathers, objective, permutes_of  # noqa: E402
from test_ssm import BATCH, LENGTH, _close, packed_batch  # noqa: E402

CHANNELS, STATE, CHUNK = 16, 4, 4  # 48 tokens over context=4: 8 ring chunks of 6, each 2 scan chunks (4 + 2)
TINY = dict(hidden_size=16, intermediate_size=32, vocab_size=128, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=64, layer_types=("mamba1", "full_attention"), mlp_layer_types=("none", "dense"),
            mamba1_intermediate_size=CHANNELS, mamba1_state_size=STATE, mamba1_dt_rank=2, linear_attention_chunk=CHUNK)


def _inputs(length, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    x, B, C = f(2, length, CHANNELS), f(2, length, STATE), f(2, length, STATE)
    dt = jax.nn.softplus(f(2, length, CHANNELS))
    A = -jnp.exp(0.5 * f(CHANNELS, STATE))
    seg = np.ones((2, length), np.int32)
    seg[1, :2], seg[1, length // 2:] = 0, 2  # row 1: left padding, then two documents
    return x, dt, A, B, C, jnp.asarray(seg)


@pytest.mark.parametrize("length", [12, 11, 3])
def test_the_chunked_scan_equals_the_recurrence(length):
    x, dt, A, B, C, seg = _inputs(length)
    state = jnp.asarray(np.random.default_rng(1).normal(size=(2, CHANNELS, STATE)), jnp.float32)
    state_seg = jnp.asarray([1, 5])  # row 0 continues its state, row 1 starts a new document
    cases = ((None, None, None), (seg, None, None), (None, state, None), (seg, state, state_seg))
    probe = jnp.cos(0.1 * jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)

    def loss(fn):
        return lambda *a: jnp.mean(fn(*a)[0] * probe)

    def every(*args):  # one compiled program for every output (op by op it is 3x slower)
        pairs = [(mamba1.selective_scan(*args, CHUNK, s, st, ss), mamba1.selective_steps(*args, s, st, ss))
                 for s, st, ss in cases]
        g1 = jax.grad(loss(lambda *a: mamba1.selective_scan(*a, CHUNK, seg, state, state_seg)), argnums=range(5))(*args)
        g2 = jax.grad(loss(lambda *a: mamba1.selective_steps(*a, seg, state, state_seg)), argnums=range(5))(*args)
        return pairs, mamba1.selective_scan(*args, CHUNK)[0], g1, g2

    pairs, unsegmented, g1, g2 = jax.jit(every, compiler_options=FAST)(x, dt, A, B, C)
    for (y1, f1), (y2, f2) in pairs:
        np.testing.assert_allclose(y1, y2, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(f1, f2, atol=1e-5, rtol=1e-5)
    assert np.abs(pairs[1][0][0] - unsegmented).max() > 1e-2  # the segments matter: selective_scan(..., seg)
    for name, a, b in zip("x dt A B C".split(), g1, g2, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=name)
        assert float(np.abs(b).max()) > 1e-3, name


@pytest.fixture(scope="module")
def reference():
    module, _ = get_model("mamba-tiny", **TINY)
    batch = packed_batch()
    boxed = jax.eval_shape(module.init, jax.random.key(0), batch["inputs"])["params"]
    params = jax.device_get(nn.unbox(jax.jit(module.init)(jax.random.key(0), batch["inputs"])["params"]))
    rng = np.random.default_rng(1)  # the mamba1 layer's weights large enough (0.3) to move the logits
    m = params["layers_0"]["mamba"]
    for name in ("in_x", "in_z", "x_dt", "x_b", "x_c", "dt", "out"):
        m[name]["kernel"] = (0.3 * rng.normal(size=m[name]["kernel"].shape)).astype(np.float32)
    m["conv"] = (0.3 * rng.normal(size=m["conv"].shape)).astype(np.float32)
    (_, logits), grads = objective(module, per_token=True)(params, batch)
    return module, boxed, params, batch, jax.device_get((logits, grads))


def test_a_model_run_by_the_recurrence_equals_the_chunked_model(reference, monkeypatch):
    """The mamba1 layer's scan replaced by the token-by-token recurrence: the same logits and
    gradients (1e-5), 48 tokens in chunks of 4, packed documents."""
    module, _, params, batch, (logits, grads) = reference
    monkeypatch.setattr(mamba1, "selective_scan", lambda x, dt, A, B, C, chunk, seg=None, state=None, state_seg=None:
                        mamba1.selective_steps(x, dt, A, B, C, seg, state, state_seg))
    (_, got), got_grads = objective(module, per_token=True)(params, batch)
    np.testing.assert_allclose(got, logits, atol=1e-5, rtol=0)
    _close(got_grads, grads)
    assert float(np.abs(grads["layers_0"]["mamba"]["A_log"]).max()) > 1e-3  # 100x the tolerance


def test_mamba1_under_context_parallelism_equals_one_device(reference):
    module, boxed, params, batch, (logits, grads) = reference
    mesh, rules = make_mesh("context=4,data=2"), get_rules("cp")
    f = objective(module.clone(placement=Placement(mesh, rules)), per_token=True)
    with activate(mesh):
        params = jax.device_put(params, logical_shardings(boxed, mesh, rules))
        compiled = f.lower(params, batch).compile()
    (_, cp_logits), cp_grads = compiled(params, batch)
    np.testing.assert_allclose(cp_logits, logits, rtol=0, atol=1e-5)
    _close(cp_grads, grads)
    hlo = compiled.as_text()
    states = permutes_of(hlo, rf"f32\[{BATCH // 2},{CHANNELS},{STATE}\]")
    # the mamba1 layer's 2N - 1 = 7 rounds of 2 permutes forward, as many back
    assert states >= 2 * 7 * 2, count_collectives(hlo)
    assert "/mamba/" in hlo and not length_gathers(hlo, LENGTH, "/mamba/")
    print(f"cp: {states} state collective-permutes, {count_collectives(hlo)}")


def test_plan_counts_the_mamba1_layers_within_15_percent_of_the_compiled_step():
    """16 x 64 under fsdp=8: the plan's total and temporaries against XLA's (measured 0.95; 0.92
    with four mamba1 layers and dense MLPs, 0.97 alternating with attention). Its FLOPs per token
    do not grow with the sequence."""
    from shardzoo.models import get_config
    from shardzoo.train.config import TrainConfig
    from shardzoo.train.tasks.registry import run_program

    config = get_config("mamba-tiny")
    program = run_program(TrainConfig(batch_size=16, seq_len=64), config, get_rules("fsdp"), make_mesh("fsdp=8"))
    totals, memory = program.plan().totals, program.compile_report()["memory"]
    assert 0.85 < totals["total"] / memory["total"] < 1.15, (totals, memory)
    temp = totals["activations"] + totals["gradients"]
    assert 0.85 < temp / memory["temp"] < 1.15, (temp, memory)
    assert config.activation_estimate(16, 64, lambda names: 1).terms["ssm_scan"] > 0
    assert config.flops_per_token(8192) == config.flops_per_token(512)


def test_the_decoding_cache_of_mamba1_layers_is_counted():
    """``costs.decode_cache_bytes`` equals the bytes of the cache the Program makes (each layer's
    float32 state and the convolution's last inputs), and does not grow with the length."""
    from shardzoo.models import get_config
    from shardzoo.models.costs import decode_cache_bytes
    from shardzoo.train.program import Program

    config = get_config("falcon-mamba-tiny")
    shapes, _ = Program(config, get_rules("fsdp"), make_mesh("fsdp=8")).decoding.cache_shardings(8, 32)
    made = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    counted = decode_cache_bytes(config.arch, 8, 32, 4)
    assert sum(counted.values()) == made
    assert decode_cache_bytes(config.arch, 8, 4096, 4) == counted
