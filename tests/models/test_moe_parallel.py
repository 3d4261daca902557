"""MoE under meshes: same losses over 3 adamw steps, all-to-all under ep, experts split per device.

Layouts compared with one device: ``ep`` on an expert=4,data=2 mesh (capacity dispatch, XLA
inserts the all-to-all), ``fsdp`` on data=2,fsdp=4, and ``shard_map`` and ``indexed`` dispatch
under ``ep``.
Groups are batch rows in every layout, so even dropped tokens are the same ones.
"""

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from shardzoo.models import get_model
from shardzoo.models.moe import MoeConfig, MoeMLP
from shardzoo.sharding import axes as ax
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import Placement, activate, logical_shardings, spec_to_sharding
from shardzoo.train.program import plan

E, D, M, B, L = 8, 16, 32, 8, 8
# LLVM at -O0 halves the CPU compile time of these tiny steps; the HLO (and so the collectives
# and the numbers compared) is the same in every layout.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
LAYOUTS = {  # name: (mesh spec, rules, dispatch)
    "one_device": (None, None, "capacity"),
    "ep": ("expert=4,data=2", "ep", "capacity"),
    "fsdp": ("data=2,fsdp=4", "fsdp", "capacity"),
    "shard_map": ("expert=4,data=2", "ep", "shard_map"),
    "indexed_ep": ("expert=4,data=2", "ep", "indexed"),
}


def all_to_all_count(hlo_text: str) -> int:
    return len(re.findall(r"\ball-to-all(-start)?\(", hlo_text))


def train_three_steps(make_loss, abstract, params, batch, batch_axes, layout):
    """3 adamw steps of ``make_loss(placement)(params, batch)`` laid out as ``layout``.

    Returns (losses, final params, compiled step text).
    """
    mesh_spec, rules_name, _ = layout
    tx = optax.adamw(3e-2)

    placement = None if mesh_spec is None else Placement(make_mesh(mesh_spec), get_rules(rules_name))
    loss_fn = make_loss(placement)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if mesh_spec is None:
        context, put = contextlib.nullcontext(), lambda tree, _: jax.device_put(tree)
        param_shardings = batch_shardings = None
    else:
        mesh, rules = make_mesh(mesh_spec), get_rules(rules_name)
        context, put = activate(mesh), jax.device_put
        param_shardings = logical_shardings(abstract, mesh, rules)
        batch_shardings = {k: spec_to_sharding(batch_axes[k], mesh, rules) for k in batch}
    with context:
        params, batch = put(params, param_shardings), put(batch, batch_shardings)
        opt_state = jax.jit(tx.init, compiler_options=FAST_COMPILE)(params)
        out_shardings = jax.tree.map(lambda a: a.sharding, (params, opt_state)) + (None,)
        compiled = jax.jit(step, out_shardings=out_shardings).lower(params, opt_state, batch).compile(FAST_COMPILE)
        losses = []
        for _ in range(3):
            params, opt_state, loss = compiled(params, opt_state, batch)
            losses.append(float(loss))
    return np.array(losses), params, compiled.as_text()


def total_aux(state):
    return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(state["losses"]))


@dataclasses.dataclass(frozen=True)
class LayerModel:
    """The MoE layer as a zoo model for planning: [batch, length, embed] in and out."""

    cfg: MoeConfig
    task = "regression"
    num_outputs = D
    trains = None

    def build(self, placement=None):
        return MoeMLP(self.cfg, placement)

    def sample_inputs(self, batch_size, seq_len):
        return (jax.ShapeDtypeStruct((batch_size, seq_len, D), jnp.float32),)

    def activation_estimate(self, batch_size, seq_len, shards):
        return None

    def pipeline_plan(self, batch_size, shards):
        return None


@pytest.fixture(scope="module")
def layer_runs():
    cfg = MoeConfig(num_experts=E, num_experts_per_tok=2, intermediate_size=M, capacity_factor=1.0,
                    aux_loss_coef=0.1, z_loss_coef=0.01)
    r = np.random.default_rng(0)
    batch = {"x": r.normal(size=(B, L, D)).astype(np.float32),
             "y": r.normal(size=(B, L, D)).astype(np.float32)}
    batch_axes = {"x": (ax.BATCH, ax.LENGTH, ax.EMBED), "y": (ax.BATCH, ax.LENGTH, ax.EMBED)}
    abstract = jax.eval_shape(MoeMLP(cfg).init, jax.random.key(0), batch["x"])["params"]
    params = jax.tree.map(lambda a: r.normal(size=a.shape).astype(np.float32) / np.sqrt(a.shape[-2]),
                          nn.meta.unbox(abstract))
    runs = {"plan_config": LayerModel(cfg)}
    for name, layout in LAYOUTS.items():
        def make_loss(placement, cfg=dataclasses.replace(cfg, dispatch=layout[2])):
            def loss_fn(params, batch):
                y, state = MoeMLP(cfg, placement).apply({"params": params}, batch["x"],
                                                        mutable=["losses", "metrics"])
                return jnp.mean((y - batch["y"]) ** 2) + total_aux(state)

            return loss_fn

        runs[name] = train_three_steps(make_loss, abstract, params, batch, batch_axes, layout)
    return runs


@pytest.fixture(scope="module")
def mixtral_runs():
    # One scanned layer keeps compile time down (stacking per layer is tested in test_moe_layer).
    overrides = dict(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                     vocab_size=64, num_local_experts=E, num_hidden_layers=1)
    model, _ = get_model("mixtral-tiny", **overrides)
    r = np.random.default_rng(1)
    tokens = r.integers(0, 64, size=(B, L + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    batch_axes = {"inputs": (ax.BATCH, ax.LENGTH), "targets": (ax.BATCH, ax.LENGTH)}
    abstract = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"])["params"]
    # numpy values in the init's tree (norm scales 1), which saves compiling the init
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: np.ones(a.shape, np.float32) if jax.tree_util.keystr(path).endswith("['scale']")
        else 0.05 * r.normal(size=a.shape).astype(np.float32), nn.meta.unbox(abstract))
    runs = {"plan_config": model.config.replace(max_position_embeddings=L)}
    for name, layout in LAYOUTS.items():
        _, config = get_model("mixtral-tiny", **overrides, moe_dispatch=layout[2])

        def make_loss(placement, config=config):
            def loss_fn(params, batch):
                logits, state = config.build(placement).apply({"params": params}, batch["inputs"],
                                                              mutable=["losses", "metrics"])
                ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
                return ce + total_aux(state)

            return loss_fn

        runs[name] = train_three_steps(make_loss, abstract, params, batch, batch_axes, layout)
    return runs


@pytest.mark.parametrize("runs", ["layer_runs", "mixtral_runs"])
def test_same_losses_over_three_adamw_steps_in_every_layout(runs, request):
    runs = request.getfixturevalue(runs)
    reference = runs["one_device"][0]
    assert reference[2] < reference[0]  # it trains
    for name in ("ep", "fsdp", "shard_map", "indexed_ep"):
        np.testing.assert_allclose(runs[name][0], reference, rtol=1e-5, atol=0, err_msg=name)


@pytest.mark.parametrize("runs", ["layer_runs", "mixtral_runs"])
def test_expert_parallel_steps_exchange_tokens_by_all_to_all(runs, request):
    runs = request.getfixturevalue(runs)
    # capacity dispatch under ep: XLA's all-to-all from the buffers' sharding constraints;
    # shard_map: the two explicit all_to_alls (forward) plus their transposes (backward).
    assert all_to_all_count(runs["ep"][2]) >= 2
    assert all_to_all_count(runs["shard_map"][2]) >= 2
    assert all_to_all_count(runs["indexed_ep"][2]) >= 2
    assert all_to_all_count(runs["one_device"][2]) == 0


def test_fsdp_moe_layer_has_no_all_to_all(layer_runs):
    assert all_to_all_count(layer_runs["fsdp"][2]) == 0  # experts not split: no token exchange


def expert_weights(params):
    """The three expert weight arrays, wherever they sit in the tree."""
    flat = jax.tree_util.tree_leaves_with_path(params)
    return {jax.tree_util.keystr(p): a for p, a in flat if re.search(r"wi_gate|wi_up|wo\b", jax.tree_util.keystr(p))}


@pytest.mark.parametrize("runs", ["layer_runs", "mixtral_runs"])
def test_expert_weights_per_device_divided_by_expert_parallel_size(runs, request):
    runs = request.getfixturevalue(runs)
    single, ep = expert_weights(runs["one_device"][1]), expert_weights(runs["ep"][1])
    assert len(ep) == 3
    for path, array in ep.items():
        expert_dim = array.ndim - 3  # after the scanned `layers` axis, if any
        shard_shape = array.addressable_shards[0].data.shape
        expected = list(single[path].shape)
        expected[expert_dim] //= 4
        assert list(shard_shape) == expected, path
        assert {s.data.shape for s in array.addressable_shards} == {shard_shape}
        assert sum(s.data.nbytes for s in array.addressable_shards) == 8 * array.nbytes // 4
    # sharding.plan, from the abstract init alone, says the same per-device shapes and bytes
    config = runs["plan_config"]
    rows = {row.array.path: row for row in plan(config, "ep", "expert=4,data=2", batch_size=B,
                                                  seq_len=L, optimizer=None).params}
    for path, array in ep.items():
        row = rows["params/" + "/".join(re.findall(r"\['(\w+)'\]", path))]
        assert row.shard_shape == array.addressable_shards[0].data.shape
        assert row.bytes_per_device == array.nbytes // 4
