"""The MLP under every preset: hand-written expected specs, and 3 adamw steps that match one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from shardzoo.models import get_model
from shardzoo.sharding import get_rules, make_mesh, plan
from shardzoo.sharding.partition import activate, logical_shardings
from shardzoo.train.aot import batch_shardings, make_train_step

B, IN, WIDTH, OUT = 16, 16, 32, 8
OVERRIDES = dict(in_features=IN, width=WIDTH, depth=2, num_outputs=OUT)

# Which mesh axes shard each dim of each parameter, per preset (depth 2: layer 0 is (embed, mlp),
# layer 1 (mlp, embed), the head (embed, vocab)). Written by hand from the rule tables.
F, T = "fsdp", "tensor"
SPECS = {
    "dp": dict(l0k=(None, None), l0b=(None,), l1k=(None, None), l1b=(None,), hk=(None, None), hb=(None,)),
    "fsdp": dict(l0k=(F, None), l0b=(None,), l1k=(None, F), l1b=(F,), hk=(F, None), hb=(None,)),
    "tp": dict(l0k=(None, T), l0b=(T,), l1k=(T, None), l1b=(None,), hk=(None, T), hb=(T,)),
    "fsdp_tp": dict(l0k=(F, T), l0b=(T,), l1k=(T, F), l1b=(F,), hk=(F, T), hb=(T,)),
    "sp": dict(l0k=(None, T), l0b=(T,), l1k=(T, None), l1b=(None,), hk=(None, T), hb=(T,)),
    "ep": dict(l0k=(F, None), l0b=(None,), l1k=(None, F), l1b=(F,), hk=(F, None), hb=(None,)),
}
PATHS = dict(l0k=("layers_0", "kernel"), l0b=("layers_0", "bias"), l1k=("layers_1", "kernel"),
             l1b=("layers_1", "bias"), hk=("head", "kernel"), hb=("head", "bias"))
# Meshes on which each preset shards something; the batch axis product is 8 or a divisor of B.
MESHES = {
    "dp": "data=8",
    "fsdp": "data=2,fsdp=4",
    "tp": "data=2,tensor=4",
    "fsdp_tp": "fsdp=2,tensor=4",
    "sp": "data=2,sequence=2,tensor=2",
    "ep": "expert=4,data=2",
}


def _padded(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


def _leaf(tree, key):
    a, b = PATHS[key]
    return tree[a][b]


@pytest.fixture(scope="module")
def setup():
    module, config = get_model("mlp-tiny", **OVERRIDES)
    rng = np.random.default_rng(0)
    batch = {
        "inputs": jnp.asarray(rng.normal(size=(B, IN)), jnp.float32),
        "targets": jnp.asarray(rng.integers(0, OUT, size=(B,)), jnp.int32),
    }
    tx = optax.adamw(1e-2)
    step = make_train_step(module, config.task, tx)

    def init(key):
        """Boxed params and the Adam state (its mu and nu boxed like their params)."""
        params = module.init(key, jnp.zeros((B, IN)))["params"]
        return params, tx.init(params)

    start = jax.device_get(nn.meta.unbox(jax.jit(init)(jax.random.key(0))))
    ref_step = jax.jit(step)
    params, opt = start
    losses = []
    for _ in range(3):
        params, opt, loss = ref_step(params, opt, batch)
        losses.append(float(loss))
    return module, config, batch, step, init, start, np.array(losses), params


@pytest.mark.parametrize("preset", list(SPECS))
def test_param_specs_match_the_hand_written_table(setup, preset):
    module, config, *_ = setup
    mesh = make_mesh(MESHES[preset])
    rules = get_rules(preset)
    with activate(mesh, rules):
        abstract = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((B, IN)))
    flax_shardings = logical_shardings(abstract, mesh, rules)["params"]
    ours = {r.array.path: r.array.spec for r in plan(config, config.sample_inputs(B), rules, mesh).params}
    for key, expected in SPECS[preset].items():
        assert _padded(_leaf(flax_shardings, key).spec, len(expected)) == expected, (preset, key)
        path = "params/" + "/".join(PATHS[key])
        assert _padded(ours[path], len(expected)) == expected, (preset, key)


@pytest.mark.parametrize("preset", list(SPECS))
def test_three_adamw_steps_match_one_device(setup, preset):
    module, config, batch, step, init, start, ref_losses, ref_params = setup
    mesh = make_mesh(MESHES[preset])
    rules = get_rules(preset)
    with activate(mesh, rules):
        # The JAX_NOTES recipe: abstract state under the rules, its shardings, the state placed
        # there (device_put of the reference start; the jitted init is tested below, once, as
        # XLA takes ~2 s of CPU to compile each init), then the jitted, donating train step.
        abstract = jax.eval_shape(init, jax.random.key(0))
        p_sh, o_sh = logical_shardings(abstract, mesh, rules)
        params, opt = jax.device_put(start, (p_sh, o_sh))
        b_sh = batch_shardings(batch, config.task, rules, mesh)
        sharded_batch = jax.device_put(batch, b_sh)
        train = jax.jit(step, in_shardings=(p_sh, o_sh, b_sh), out_shardings=(p_sh, o_sh, None),
                        donate_argnums=(0, 1))
        losses = []
        for _ in range(3):
            params, opt, loss = train(params, opt, sharded_batch)
            losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[2] < losses[0]  # it trains
    # The parameters really live as the table says: each device holds the expected block.
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    for key, spec in SPECS[preset].items():
        leaf = _leaf(params, key)
        expected = tuple(n // (sizes[a] if a else 1) for n, a in zip(leaf.shape, spec, strict=True))
        assert leaf.addressable_shards[0].data.shape == expected, (preset, key)
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(_leaf(ref_params, key)), atol=1e-5)
        assert _leaf(opt[0].nu, key).addressable_shards[0].data.shape == expected, (preset, key)
    # The batch is split as the preset says (dp: data=8 -> 2 rows per device).
    batch_axes = {"dp": 8, "fsdp": 8, "tp": 2, "fsdp_tp": 2, "sp": 2, "ep": 8}[preset]
    assert sharded_batch["inputs"].addressable_shards[0].data.shape == (B // batch_axes, IN)


def test_jitted_init_lands_sharded_with_the_reference_values(setup):
    module, config, batch, step, init, start, *_ = setup
    mesh, rules = make_mesh(MESHES["fsdp_tp"]), get_rules("fsdp_tp")
    with activate(mesh, rules):
        abstract = jax.eval_shape(init, jax.random.key(0))
        shardings = logical_shardings(abstract, mesh, rules)
        params, opt = nn.meta.unbox(jax.jit(init, out_shardings=shardings)(jax.random.key(0)))
    for key, spec in SPECS["fsdp_tp"].items():
        leaf = _leaf(params, key)
        assert _padded(leaf.sharding.spec, len(spec)) == spec, key
        np.testing.assert_array_equal(np.asarray(leaf), _leaf(start[0], key))
    # Adam's mu mirrors its parameter's sharding.
    mu = opt[0].mu
    assert _leaf(mu, "l0k").sharding.spec == _leaf(params, "l0k").sharding.spec
