"""The MLP under every preset: hand-written expected specs, and 3 adamw steps that match one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from shardzoo.models import get_model
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.program import Program, plan

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


def adamw(boxed_params):
    return optax.adamw(1e-2), optax.constant_schedule(1e-2)


def program_on(config, preset=None):
    """The one train program of the MLP (classification task) under ``preset`` (None: 1 device)."""
    if preset is None:
        return Program(config, get_rules("dp"), make_mesh("data=1", devices=jax.devices()[:1]),
                       optimizer=adamw, batch_size=B)
    return Program(config, get_rules(preset), make_mesh(MESHES[preset]), optimizer=adamw, batch_size=B)


RNG = np.zeros(2, np.uint32)


@pytest.fixture(scope="module")
def setup():
    module, config = get_model("mlp-tiny", **OVERRIDES)
    rng = np.random.default_rng(0)
    batch = {
        "inputs": rng.normal(size=(B, IN)).astype(np.float32),
        "targets": rng.integers(0, OUT, size=(B,)).astype(np.int32),
        "weights": np.ones((B,), np.float32),
    }
    ref = program_on(config)
    state = ref.init(np.asarray(jax.random.PRNGKey(0), np.uint32))
    start = jax.device_get(state)
    step = ref.compiled_train_step()
    losses = []
    for _ in range(3):
        state, metrics = step(state, ref.place(batch), RNG)
        losses.append(float(metrics["loss"]))
    return module, config, batch, start, np.array(losses), jax.device_get(state.params)


@pytest.mark.parametrize("preset", list(SPECS))
def test_param_specs_match_the_hand_written_table(setup, preset):
    module, config, *_ = setup
    mesh = make_mesh(MESHES[preset])
    rules = get_rules(preset)
    abstract = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((B, IN)))
    # flax's own resolver, as an independent check of shardzoo's (sharding/partition.py)
    flax_shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, tuple(rules))["params"]
    ours = {r.array.path: r.array.spec for r in plan(config, rules, mesh, batch_size=B).params}
    for key, expected in SPECS[preset].items():
        assert _padded(_leaf(flax_shardings, key).spec, len(expected)) == expected, (preset, key)
        path = "params/" + "/".join(PATHS[key])
        assert _padded(ours[path], len(expected)) == expected, (preset, key)


@pytest.mark.parametrize("preset", list(SPECS))
def test_three_adamw_steps_match_one_device(setup, preset):
    module, config, batch, start, ref_losses, ref_params = setup
    program = program_on(config, preset)  # the step `shardzoo train` runs (classification task)
    state = jax.device_put(start, program.shardings)
    step = program.compiled_train_step()
    sharded_batch = program.place(batch)
    losses = []
    for _ in range(3):
        state, metrics = step(state, sharded_batch, RNG)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[2] < losses[0]  # it trains
    # The parameters really live as the table says: each device holds the expected block.
    mesh = program.mesh
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    for key, spec in SPECS[preset].items():
        leaf = _leaf(state.params, key)
        expected = tuple(n // (sizes[a] if a else 1) for n, a in zip(leaf.shape, spec, strict=True))
        assert leaf.addressable_shards[0].data.shape == expected, (preset, key)
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(_leaf(ref_params, key)), atol=1e-5)
        assert _leaf(state.opt_state[0].nu, key).addressable_shards[0].data.shape == expected, (preset, key)
    # The batch is split as the preset says (dp: data=8 -> 2 rows per device).
    batch_axes = {"dp": 8, "fsdp": 8, "tp": 2, "fsdp_tp": 2, "sp": 2, "ep": 8}[preset]
    assert sharded_batch["inputs"].addressable_shards[0].data.shape == (B // batch_axes, IN)


def test_jitted_init_lands_sharded_with_the_reference_values(setup):
    module, config, batch, start, *_ = setup
    program = program_on(config, "fsdp_tp")
    state = program.init(np.asarray(jax.random.PRNGKey(0), np.uint32))
    for key, spec in SPECS["fsdp_tp"].items():
        leaf = _leaf(state.params, key)
        assert _padded(leaf.sharding.spec, len(spec)) == spec, key
        np.testing.assert_array_equal(np.asarray(leaf), _leaf(start.params, key))
    # Adam's mu mirrors its parameter's sharding.
    mu = state.opt_state[0].mu
    assert _leaf(mu, "l0k").sharding.spec == _leaf(state.params, "l0k").sharding.spec
