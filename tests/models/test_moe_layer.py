"""MoeMLP: every dispatch strategy against a dense reference, hand-worked drops, router losses."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from shardzoo.errors import UserError
from shardzoo.models.moe import MoeConfig, MoeMLP
from shardzoo.models.moe_dispatch import ExpertAxisError, MoeError
from shardzoo.sharding import axes as ax
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import Placement, activate

E, D, M = 8, 16, 32
# LLVM at -O0 halves the CPU compile time of these tiny programs (same HLO, same numbers).
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
CFG = MoeConfig(num_experts=E, num_experts_per_tok=2, intermediate_size=M, capacity_factor=E / 2)


def make_params(num_experts=E, router_scale=0.25, seed=0):
    """Random parameters in MoeMLP's tree (checked against init below), built in numpy.

    Router weights larger than the 0.02 init keep the top-k choices far from ties; expert
    weights of order 1/sqrt(fan_in) keep outputs O(1), so the tolerances mean something.
    """
    r = np.random.default_rng(seed)
    normal = lambda *shape: r.normal(size=shape).astype(np.float32)
    return {
        "router": {"kernel": router_scale * normal(D, num_experts)},
        "wi_gate": normal(num_experts, D, M) / np.sqrt(D),
        "wi_up": normal(num_experts, D, M) / np.sqrt(D),
        "wo": normal(num_experts, M, D) / np.sqrt(M),
    }


def test_params_tree_and_logical_axes():
    abstract = jax.eval_shape(MoeMLP(CFG).init, jax.random.key(0), jnp.zeros((2, 4, D)))["params"]
    shapes = jax.tree.map(lambda a: a.shape, nn.meta.unbox(abstract))
    assert shapes == jax.tree.map(np.shape, make_params())
    specs = jax.tree.map(tuple, nn.get_partition_spec(abstract))
    assert specs == {
        "router": {"kernel": (ax.EMBED, ax.EXPERT)},
        "wi_gate": (ax.EXPERT, ax.EMBED, ax.MLP),
        "wi_up": (ax.EXPERT, ax.EMBED, ax.MLP),
        "wo": (ax.EXPERT, ax.MLP, ax.EMBED),
    }


def dense_reference(params, x, k=2, norm_topk=True):
    """Every token through every expert, weighted by its top-k probabilities (0 elsewhere)."""
    probs = jax.nn.softmax(x @ params["router"]["kernel"], axis=-1)
    top_p, top_idx = jax.lax.top_k(probs, k)
    if norm_topk:
        top_p = top_p / top_p.sum(-1, keepdims=True)
    out = jnp.zeros_like(x)
    for e in range(params["wi_gate"].shape[0]):
        h = jax.nn.silu(x @ params["wi_gate"][e]) * (x @ params["wi_up"][e])
        weight = jnp.sum(jnp.where(top_idx == e, top_p, 0.0), axis=-1)  # [batch, length]
        out = out + weight[..., None] * (h @ params["wo"][e])
    return out


def output_and_grads(fn):
    """A jitted (params, x) -> (fn(params, x), d<fn, fixed random projection>/d(params, x))."""

    def both(params, x):
        proj = jax.random.normal(jax.random.key(7), x.shape)
        y, vjp = jax.vjp(fn, params, x)
        return y, vjp(proj)

    return jit(both)


def assert_trees_close(a, b, atol):
    for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(u, v, atol=atol, rtol=0, err_msg=jax.tree_util.keystr(path))


def moe_fn(cfg, placement=None):
    return lambda p, x: MoeMLP(cfg, placement).apply({"params": p}, x)


@pytest.fixture(scope="module")
def problem():
    x = np.random.default_rng(1).normal(size=(8, 8, D)).astype(np.float32)
    params = make_params()
    return params, x, output_and_grads(dense_reference)(params, x)


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_dispatch_matches_dense_reference(problem, dispatch):
    params, x, (y_ref, g_ref) = problem
    y, g = output_and_grads(moe_fn(dataclasses.replace(CFG, dispatch=dispatch)))(params, x)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=0)
    assert_trees_close(g, g_ref, atol=1e-5)


@pytest.mark.parametrize("dispatch", ["capacity", "shard_map"])
def test_expert_parallel_matches_dense_reference(problem, dispatch):
    params, x, (y_ref, g_ref) = problem
    mesh = make_mesh("expert=4,data=2")
    fn = moe_fn(dataclasses.replace(CFG, dispatch=dispatch), Placement(mesh, get_rules("ep")))
    with activate(mesh):
        y, g = output_and_grads(fn)(params, x)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=0)
    assert_trees_close(g, g_ref, atol=1e-5)


# Hand-worked drops: 4 experts, top-2, 6 tokens a row, capacity_factor 0.5
# -> capacity = ceil(0.5 * 6 * 2 / 4) = 2 slots per expert and row.
# Router logits are the first 4 input features (router kernel = identity on them).
#   token  top-1  top-2     filling order: top-1 choices in token order, then top-2 choices
#   t0     e0     e1        e0: t0, t1 | t2 dropped        e1: t3, t5 (top-1s)
#   t1     e0     e2        e2: t4, then t1's top-2        e3: t4's and t5's top-2
#   t2     e0     e1        top-2s dropped: t0->e1 (full, though t0 comes before t3 and t5),
#   t3     e1     e0                        t2->e1, t3->e0
#   t4     e2     e3
#   t5     e1     e3        kept: t0:{e0} t1:{e0,e2} t2:{} t3:{e1} t4:{e2,e3} t5:{e1,e3}
HAND_LOGITS = [[3, 2, 0, -1], [3, 0, 2, -1], [3, 2, 0, -1], [2, 3, 0, -1], [-1, 0, 3, 2], [0, 3, -1, 2]]
HAND_KEPT = [{0}, {0, 2}, set(), {1}, {2, 3}, {1, 3}]


@pytest.mark.parametrize("dispatch", ["capacity", "shard_map", "indexed"])
def test_capacity_drops_hand_worked_example(dispatch):
    cfg = MoeConfig(num_experts=4, num_experts_per_tok=2, intermediate_size=M, capacity_factor=0.5,
                    dispatch=dispatch)
    batch = 8  # every row has the same routing; the other features differ per row
    x = np.random.default_rng(3).normal(size=(batch, 6, D)).astype(np.float32)
    x[:, :, :4] = HAND_LOGITS
    params = make_params(num_experts=4)
    params["router"]["kernel"] = np.eye(D, 4, dtype=np.float32)
    mesh = make_mesh("expert=4,data=2")
    module = MoeMLP(cfg, Placement(mesh, get_rules("ep")))
    with activate(mesh):
        y, state = jit(lambda p, x: module.apply({"params": p}, x, mutable=["metrics"]))(params, x)

    xn, p = np.asarray(x, np.float64), jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    probs = np.exp(np.asarray(HAND_LOGITS, np.float64))
    probs /= probs.sum(-1, keepdims=True)  # [token, expert]
    expected = np.zeros(x.shape)
    for t, kept in enumerate(HAND_KEPT):
        top2 = np.sort(probs[t])[-2:].sum()
        for e in kept:
            gate = xn[:, t] @ p["wi_gate"][e]
            h = gate / (1 + np.exp(-gate)) * (xn[:, t] @ p["wi_up"][e])
            expected[:, t] += probs[t, e] / top2 * (h @ p["wo"][e])
    np.testing.assert_allclose(y, expected, atol=1e-5, rtol=0)
    assert np.all(np.asarray(y[:, 2]) == 0.0)  # t2 lost both choices: the layer adds nothing
    assert np.all(np.abs(np.asarray(y[:, [0, 1, 3, 4, 5]])).sum(-1) > 0)
    (dropped,) = state["metrics"]["dropped_fraction"]
    np.testing.assert_allclose(dropped, 4 / 12, rtol=1e-6)  # 4 of 6*2 assignments per row


def test_padding_takes_no_slot_and_no_loss():
    """Masked tokens (padding) are not routed: a real token gets the slot, losses skip them."""
    cfg = MoeConfig(num_experts=4, num_experts_per_tok=2, intermediate_size=M, capacity_factor=0.5)
    x = np.random.default_rng(3).normal(size=(2, 6, D)).astype(np.float32)
    x[:, :, :4] = HAND_LOGITS
    params = make_params(num_experts=4)
    params["router"]["kernel"] = np.eye(D, 4, dtype=np.float32)
    mask = np.ones((2, 6), bool)
    mask[:, 0] = False  # t0 is padding: its top-1 slot in e0 goes to t2 (unrouted before)
    apply = jit(lambda p, x, m: MoeMLP(cfg).apply({"params": p}, x, token_mask=m,
                                                  mutable=["losses", "metrics"]))
    y, state = apply(params, x, mask)
    y_all, _ = apply(params, x, np.ones_like(mask))
    assert np.all(np.asarray(y_all[:, 2]) == 0.0) and np.all(np.abs(np.asarray(y[:, 2])).sum(-1) > 0)
    assert np.all(np.asarray(y[:, 0]) == 0.0)  # padding gets nothing
    # routed t1..t5 by hand: top-1 t1,t2->e0 t3,t5->e1 t4->e2; top-2 t1->e2 t4,t5->e3, and
    # t2->e1, t3->e0 find their experts full: 2 of the 10 real assignments dropped
    np.testing.assert_allclose(state["metrics"]["dropped_fraction"][0], 2 / 10, rtol=1e-6)
    # the losses are those of the real tokens alone
    cfg_free = dataclasses.replace(cfg, capacity_factor=4.0)
    _, masked = jit(lambda p, x, m: MoeMLP(cfg_free).apply({"params": p}, x, token_mask=m,
                                                           mutable=["metrics"]))(params, x, mask)
    _, alone = jit(lambda p, x: MoeMLP(cfg_free).apply({"params": p}, x, mutable=["metrics"]))(
        params, x[:, 1:])
    for name in ("load_balance_loss", "router_z_loss"):
        np.testing.assert_allclose(masked["metrics"][name][0], alone["metrics"][name][0], rtol=1e-6)


def test_router_losses_match_numpy_formula():
    cfg = dataclasses.replace(CFG, aux_loss_coef=0.03, z_loss_coef=0.002)
    x = np.random.default_rng(4).normal(size=(2, 8, D)).astype(np.float32)
    params = make_params(router_scale=0.1)
    apply = jit(lambda p, x: MoeMLP(cfg).apply({"params": p}, x, mutable=["losses", "metrics"]))
    _, state = apply(params, x)

    logits = np.asarray(x, np.float64).reshape(-1, D) @ np.asarray(params["router"]["kernel"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1)[:, :2]  # [tokens, k]
    f = np.stack([(chosen == e).sum(-1) for e in range(E)], -1).mean(0)  # top-k assignments per token
    load_balance = E * np.sum(f * probs.mean(0))  # HF Mixtral's load_balancing_loss_func
    lse = np.log(np.exp(logits).sum(-1))
    z_loss = np.mean(lse**2)

    metrics = state["metrics"]
    np.testing.assert_allclose(metrics["load_balance_loss"][0], load_balance, rtol=1e-5)
    np.testing.assert_allclose(metrics["router_z_loss"][0], z_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["dropped_fraction"][0], 0.0, atol=0)
    np.testing.assert_allclose(
        state["losses"]["moe_aux_loss"][0], 0.03 * load_balance + 0.002 * z_loss, rtol=1e-5
    )
    assert 1.0 < load_balance < E * 2  # the formula's range for top-2 (2 = perfectly balanced)


class TwoScannedLayers(nn.Module):
    config: MoeConfig

    @nn.compact
    def __call__(self, x, deterministic=True):
        class Layer(nn.Module):
            config: MoeConfig

            @nn.compact
            def __call__(self, x, _):
                return x + MoeMLP(self.config, name="moe")(x, deterministic), None

        stack = nn.scan(Layer, variable_axes={"params": 0, "losses": 0, "metrics": 0},
                        split_rngs={"params": True, "dropout": True}, length=2,
                        metadata_params={nn.PARTITION_NAME: ax.LAYERS})
        return stack(self.config, name="layers")(x, None)[0]


def test_sown_values_stack_one_scalar_per_scanned_layer():
    x = np.random.default_rng(5).normal(size=(2, 8, D)).astype(np.float32)
    module = TwoScannedLayers(CFG)
    abstract = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    assert tuple(nn.get_partition_spec(abstract)["layers"]["moe"]["wi_gate"]) == (
        ax.LAYERS, ax.EXPERT, ax.EMBED, ax.MLP)
    params = {"layers": {"moe": jax.tree.map(lambda a, b: np.stack([a, b]), make_params(seed=1),
                                             make_params(seed=2))}}
    _, state = jit(lambda p, x: module.apply({"params": p}, x, mutable=["losses", "metrics"]))(
        params, x)
    leaves = {jax.tree_util.keystr(p): v.shape for p, v in jax.tree_util.tree_leaves_with_path(state)}
    assert leaves == {
        "['losses']['layers']['moe']['moe_aux_loss'][0]": (2,),
        "['metrics']['layers']['moe']['dropped_fraction'][0]": (2,),
        "['metrics']['layers']['moe']['load_balance_loss'][0]": (2,),
        "['metrics']['layers']['moe']['router_z_loss'][0]": (2,),
    }
    z = state["metrics"]["layers"]["moe"]["router_z_loss"][0]
    assert z[0] != z[1]  # each layer's own value, not one broadcast


def test_router_jitter_uses_dropout_rng_in_training_only(problem):
    params, x, (clean, _) = problem  # clean: the dense reference, no noise
    module = MoeMLP(dataclasses.replace(CFG, router_jitter_noise=0.9))
    train = jit(lambda key: module.apply({"params": params}, x, deterministic=False,
                                             rngs={"dropout": key}))
    evaluate = jit(lambda: module.apply({"params": params}, x, deterministic=True))
    np.testing.assert_allclose(evaluate(), clean, atol=1e-5, rtol=0)
    noisy0, noisy0_again, noisy1 = train(jax.random.key(0)), train(jax.random.key(0)), train(jax.random.key(1))
    np.testing.assert_array_equal(noisy0, noisy0_again)
    assert np.abs(np.asarray(noisy0 - clean)).max() > 1e-3
    assert np.abs(np.asarray(noisy0 - noisy1)).max() > 1e-3


def test_shard_map_without_expert_mesh_axis_is_a_user_error():
    cfg = dataclasses.replace(CFG, dispatch="shard_map")
    x = np.ones((8, 4, D), np.float32)
    params = make_params()
    mesh = make_mesh("data=2,fsdp=4")
    with activate(mesh):
        with pytest.raises(ExpertAxisError, match="'expert' on a mesh axis"):
            jit(moe_fn(cfg, Placement(mesh, get_rules("fsdp"))))(params, x)
    with pytest.raises(ExpertAxisError, match="no mesh"):
        jit(moe_fn(cfg))(params, x)
    assert issubclass(ExpertAxisError, UserError)


def test_bad_config_is_a_user_error():
    with pytest.raises(MoeError, match="dispatch='sorted'"):
        MoeConfig(dispatch="sorted")
    with pytest.raises(MoeError, match="num_experts_per_tok=3"):
        MoeConfig(num_experts=2, num_experts_per_tok=3)


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_padding_ids_change_nothing_in_an_moe_transformer(dispatch):
    """Packed rows end in padding (segment 0): its token ids reach neither the real tokens'
    logits (attention and expert capacity) nor the router losses."""
    from shardzoo.models import get_model

    module, config = get_model("mixtral-tiny", moe_dispatch=dispatch, capacity_factor=0.5,
                               num_hidden_layers=1)
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, config.vocab_size, (2, 16))
    segments = np.array([[1] * 10 + [0] * 6, [1] * 5 + [2] * 7 + [0] * 4])
    positions = np.concatenate([np.arange(10), np.arange(6), np.arange(5), np.arange(11)]).reshape(2, 16)
    other = np.where(segments > 0, tokens, rng.integers(0, config.vocab_size, tokens.shape))
    params = jit(module.init)(jax.random.key(0), tokens[:, :8])["params"]

    def run(p, t):
        return module.apply({"params": p}, t, positions, segments, mutable=["losses", "metrics"])

    (a, sa), (b, sb) = jit(lambda p: (run(p, tokens), run(p, other)))(params)
    real = segments > 0
    np.testing.assert_allclose(np.asarray(a)[real], np.asarray(b)[real], atol=1e-6, rtol=0)
    assert not np.allclose(np.asarray(a)[~real], np.asarray(b)[~real])  # padding ids did differ
    for got, want in zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
