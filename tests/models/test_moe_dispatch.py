"""The indexed MoE dispatch against the capacity (einsum) dispatch it replaces: the same outputs,
gradients, losses and drops (GShard priority); no one-hot masks."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardzoo.models.moe import MoeConfig, MoeMLP

E, K, D, M, B, L = 8, 2, 16, 32, 8, 16
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
CFG = MoeConfig(num_experts=E, num_experts_per_tok=K, intermediate_size=M, aux_loss_coef=0.1,
                z_loss_coef=0.01)


def make_params(seed=0):
    r = np.random.default_rng(seed)
    normal = lambda *shape: r.normal(size=shape).astype(np.float32) / np.sqrt(shape[-2])
    return {"router": {"kernel": 2 * normal(D, E)}, "wi_gate": normal(E, D, M),
            "wi_up": normal(E, D, M), "wo": normal(E, M, D)}


def run(cfg, params, x, token_mask=None):
    """(output, sown collections, d<output, projection> + aux / d(params, x)), jitted."""
    proj = jnp.asarray(np.random.default_rng(9).normal(size=x.shape).astype(np.float32))

    def loss(params, x):
        y, state = MoeMLP(cfg).apply({"params": params}, x, token_mask=token_mask,
                                     mutable=["losses", "metrics"])
        return jnp.sum(y * proj) + state["losses"]["moe_aux_loss"][0], (y, state)

    (_, (y, state)), grads = jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, state, grads


def intermediate_shapes(jaxpr):
    """Shapes of every value a jaxpr computes, inside nested jaxprs (jit, custom_jvp) too."""
    for eqn in jaxpr.eqns:
        yield from (v.aval.shape for v in eqn.outvars)
        for sub in jax.tree.leaves(eqn.params, is_leaf=lambda p: hasattr(p, "eqns") or hasattr(p, "jaxpr")):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                yield from intermediate_shapes(inner)


def assert_trees_close(a, b, atol=1e-5):
    for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(u, v, atol=atol, rtol=0, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(1).normal(size=(B, L, D)).astype(np.float32)


# Unmasked with drops, and under ep: test_moe_parallel.py's indexed_ep layout (3 adamw steps,
# the capacity dispatch on one device as the reference) and test_moe_layer.py's hand-worked drops.
@pytest.mark.parametrize("capacity_factor, masked", [(0.5, True), (E / K, False)])
def test_indexed_equals_capacity_outputs_gradients_losses_and_drops(x, capacity_factor, masked):
    params = make_params()
    mask = None
    if masked:  # padding at the ends of rows takes no slot
        mask = np.ones((B, L), bool)
        mask[::2, -5:] = False
    cfg = dataclasses.replace(CFG, capacity_factor=capacity_factor)
    y_cap, s_cap, g_cap = run(dataclasses.replace(cfg, dispatch="capacity"), params, x, mask)
    y_idx, s_idx, g_idx = run(dataclasses.replace(cfg, dispatch="indexed"), params, x, mask)
    np.testing.assert_allclose(y_idx, y_cap, atol=1e-5, rtol=0)
    assert_trees_close(g_idx, g_cap)
    assert_trees_close(s_idx, s_cap)
    dropped = float(s_idx["metrics"]["dropped_fraction"][0])
    if capacity_factor < 1:
        assert dropped > 0.1  # drops happened, and the same ones (the outputs agree)
        assert np.any(np.all(np.asarray(y_idx) == 0, axis=-1))  # some token lost every choice
    else:
        assert abs(dropped) < 1e-6


def test_indexed_builds_no_one_hot_dispatch_masks(x):
    """The capacity dispatch's [batch, length, expert, capacity] masks are what the indexed one
    avoids (their cost grows with experts x capacity); none of its intermediates has that shape."""
    params = make_params()
    capacity = CFG.capacity(L)
    mask_shape = (B, L, E, capacity)

    def shapes(dispatch):
        cfg = dataclasses.replace(CFG, dispatch=dispatch)
        fn = lambda p, x: jax.grad(lambda p: MoeMLP(cfg).apply({"params": p}, x).sum())(p)
        return set(intermediate_shapes(jax.make_jaxpr(fn)(params, x).jaxpr))

    assert mask_shape in shapes("capacity")
    assert mask_shape not in shapes("indexed")
