"""DeepSeek-V3's auxiliary-loss-free balancing (``router_bias_update_rate``): after each step
every MoE layer's routing bias moves by the rate, up for experts that took less than their
share of the step's (token, choice) pairs and down for more, outside the gradient; off by default.

The tiny DeepSeek-V3 preset (a dense layer unrolled, two scanned MoE layers, 8 experts top-2),
float32, one device. The learning rate is 0, so only the balancing changes the params.
"""

import jax
import numpy as np
import optax
import pytest

from shardzoo.models import ModelError, get_config
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import activate
from shardzoo.train.program import Program

RATE = 0.001  # DeepSeek-V3's gamma
ROWS, LENGTH = 4, 16


def frozen_optimizer(_boxed):
    return optax.sgd(0.0), optax.constant_schedule(0.0)


def batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, size=(ROWS, LENGTH)).astype(np.int32)  # a narrow vocabulary: skewed routing
    return dict(inputs=tokens, targets=np.roll(tokens, -1, 1), weights=np.ones((ROWS, LENGTH), np.float32),
                positions=np.broadcast_to(np.arange(LENGTH, dtype=np.int32), (ROWS, LENGTH)).copy(),
                segment_ids=np.ones((ROWS, LENGTH), np.int32))


@pytest.fixture(scope="module")
def programs():
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    out = {}
    for rate in (0.0, RATE):
        config = get_config("deepseek-v3-tiny", router_bias_update_rate=rate)
        out[rate] = Program(config, get_rules("fsdp"), mesh, optimizer=frozen_optimizer, batch_size=ROWS,
                            seq_len=LENGTH)
    return out


def _placed(program, b):
    return program.place(b)


def loads_of(program, params, b):
    """Each MoE layer's share of the (token, choice) pairs per expert, from the model itself
    (jitted: one compile costs less than the model's ops dispatched one by one)."""
    def apply(params, b):
        _, state = program.module.apply({"params": params}, b["inputs"], positions=b["positions"],
                                        segment_ids=b["segment_ids"], mutable=["router_load"])
        return state["router_load"]["layers"]["moe"]["expert_load"][0]  # [layers, expert]

    with activate(program.mesh):
        return np.asarray(jax.jit(apply)(params, b))


def test_the_bias_moves_by_the_rate_against_each_experts_excess_load(programs):
    program = programs[RATE]
    state = program.init(jax.random.key(0))
    start = jax.device_get(state.params)
    bias0 = np.asarray(start["layers"]["moe"]["router_bias"])  # [2 MoE layers, 8 experts]
    assert np.all(bias0 == 0)
    b = batch()
    load = loads_of(program, start, b)
    np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-6)
    share = 1 / 8
    assert np.max(load) > 1.5 * share  # the routing is skewed: the test can tell balancing from none
    new_state, metrics = program.compiled_train_step()(state, _placed(program, b), jax.random.key_data(
        jax.random.key(1)))
    params = jax.device_get(new_state.params)
    np.testing.assert_allclose(params["layers"]["moe"]["router_bias"], bias0 + RATE * np.sign(share - load),
                               atol=1e-7, rtol=0)
    np.testing.assert_allclose(float(metrics["expert_load_max_violation"]), np.max(load) / share - 1, rtol=1e-5)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:  # nothing else moved (lr 0)
        if "router_bias" not in jax.tree_util.keystr(path):
            np.testing.assert_array_equal(leaf, _at(start, path))


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_repeated_steps_balance_the_experts_and_off_by_default_nothing_moves(programs):
    """60 steps on one batch: off, the bias stays 0 and the imbalance stays; on, the max
    violation (DeepSeek's MaxVio, measured before each step's update) falls well below it."""
    b = batch()
    off = programs[0.0]
    state = off.init(jax.random.key(0))
    before = np.max(loads_of(off, jax.device_get(state.params), b)) * 8 - 1
    for _ in range(3):
        state, metrics = off.compiled_train_step()(state, off.place(b), jax.random.key_data(jax.random.key(1)))
    assert "expert_load_max_violation" not in metrics
    assert np.all(np.asarray(jax.device_get(state.params)["layers"]["moe"]["router_bias"]) == 0)
    on = programs[RATE]
    state, seen = on.init(jax.random.key(0)), []
    for _ in range(60):
        state, metrics = on.compiled_train_step()(state, on.place(b), jax.random.key_data(jax.random.key(1)))
        seen.append(float(metrics["expert_load_max_violation"]))
    assert seen[0] == pytest.approx(before, rel=1e-5)
    late = float(np.mean(seen[-20:]))
    print(f"max violation: off {before:.3f}, on (mean of the last 20 of 60 steps) {late:.3f}")
    assert late < 0.4 * before


def test_a_router_without_a_correction_bias_is_refused_naming_the_field():
    with pytest.raises(ModelError, match="router_bias_update_rate.*sigmoid_groups.*'softmax_groups'"):
        get_config("deepseek-v2-tiny", router_bias_update_rate=0.001)
    with pytest.raises(ModelError, match="router_bias_update_rate=-1.*>= 0"):
        get_config("deepseek-v3-tiny", router_bias_update_rate=-1.0)


def test_under_gradient_accumulation_the_load_is_the_whole_batchs(programs):
    """Two microbatches of equal weight: the mean of their shares is the whole batch's share,
    so one step moves the bias as the single-batch step does."""
    b = batch()
    one = programs[RATE]
    two = Program(one.config, get_rules("fsdp"), one.mesh, optimizer=frozen_optimizer, batch_size=ROWS,
                  seq_len=LENGTH, grad_accum=2)
    key = jax.random.key_data(jax.random.key(1))
    got = {}
    for name, program in (("one", one), ("two", two)):
        state, metrics = program.compiled_train_step()(program.init(jax.random.key(0)), program.place(b), key)
        got[name] = (np.asarray(jax.device_get(state.params)["layers"]["moe"]["router_bias"]),
                     float(metrics["expert_load_max_violation"]))
    assert np.any(got["one"][0] != 0)
    np.testing.assert_allclose(got["two"][0], got["one"][0], atol=1e-7, rtol=0)
