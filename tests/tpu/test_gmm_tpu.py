"""The gmm MoE dispatch (megablox's Pallas grouped matmul, compiled by Mosaic) on a TPU, bfloat16,
against the indexed dispatch (XLA) and a float32 reference. Skips off a TPU.

    JAX_PLATFORMS=tpu python3 -m pytest -q -p no:cacheprovider tests/tpu/test_gmm_tpu.py

Reference: the dropless dispatch (ragged_dot) in float32 on the same (bfloat16) weights and inputs.
Tolerance, per array (the output and the gradients of <output, projection> + aux loss by the
input, the router and every expert weight): ||a - ref|| / ||ref|| no more than 1.5 x the indexed
dispatch's own error + 1e-3 (gmm is as close to exact as XLA's bfloat16 path), and under 2e-2
(bfloat16 rounds each matmul's inputs and the hidden to 2^-9; seen on CPU at the small shapes:
5e-3 for both dispatches). GPT-OSS's clamp, whose gradient jumps where rounding moves a value
across the limit, is decided on the gate's and up's float32 accumulation (``wide_hidden``): with
a bfloat16 output gmm strayed to 3.5e-2 on the chip where indexed (whose fusions keep the
matmul's float32 there) stayed at 4.8e-3; with the float32 one, 4e-3 on CPU. Capacity factor 2
is twice the mean load, so the indexed dispatch drops nothing (asserted).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardzoo.models.moe import MoeConfig, MoeMLP


def step(cfg, params, x, proj):
    """(output, dropped fraction, grads of <output, proj> + aux by (params, x)), float32 out."""

    def loss(params, x):
        y, state = MoeMLP(cfg).apply({"params": params}, x, mutable=["losses", "metrics"])
        aux = state["losses"]["moe_aux_loss"][0]
        return jnp.sum(y.astype(jnp.float32) * proj) + aux, (y, state["metrics"]["dropped_fraction"][0])

    (_, (y, dropped)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    out = jax.tree.map(lambda a: np.asarray(a, np.float32), {"output": y, "grads": grads})
    return out, float(dropped)


def relative_errors(cfg, batch, length, embed, seed=0):
    """{array path: (gmm's error, indexed's error)} against the float32 dropless reference."""
    boxed = jax.eval_shape(MoeMLP(cfg).init, jax.random.key(0), jnp.zeros((batch, length, embed)))["params"]
    r = np.random.default_rng(seed)
    params = jax.tree.map(lambda b: jnp.asarray(r.normal(size=b.value.shape) / np.sqrt(b.value.shape[-2] if b.value.ndim > 1 else 4),
                                                jnp.bfloat16), boxed, is_leaf=lambda b: hasattr(b, "unbox"))
    x = jnp.asarray(r.normal(size=(batch, length, embed)), jnp.bfloat16)
    proj = jnp.asarray(r.normal(size=(batch, length, embed)), jnp.float32)
    ref, _ = step(dataclasses.replace(cfg, dispatch="dropless", dtype="float32"), params, x.astype(jnp.float32), proj)
    got, _ = step(dataclasses.replace(cfg, dispatch="gmm"), params, x, proj)
    idx, dropped = step(dataclasses.replace(cfg, dispatch="indexed"), params, x, proj)
    assert dropped == 0.0
    err = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(ref)]
    flat = [jax.tree.leaves(t) for t in (got, idx, ref)]
    return {p: (err(g, f), err(i, f)) for p, g, i, f in zip(paths, *flat, strict=True)}


def check(errors, bound=2e-2):
    shown = "\n".join(f"{p}: gmm {g:.2e}, indexed {i:.2e}" for p, (g, i) in errors.items())
    print(shown)
    for p, (g, i) in errors.items():
        assert g < bound and g <= 1.5 * i + 1e-3, f"{p}: gmm {g:.2e}, indexed {i:.2e}\n{shown}"


def test_qwen3_30b_a3b_layer_bfloat16():
    """Its MoE layer: embed 2048, expert 768, 128 experts top-8; 8192 tokens (4 rows of 2048)."""
    cfg = MoeConfig(num_experts=128, num_experts_per_tok=8, intermediate_size=768, capacity_factor=2.0,
                    dtype="bfloat16", param_dtype="bfloat16")
    check(relative_errors(cfg, 4, 2048, 2048))


@pytest.mark.parametrize("fields", [dict(), dict(expert_type="plain", hidden_act="relu2"),
                                    dict(swiglu_limit=0.5, expert_bias=True, router_bias=True)],
                         ids=["gated", "plain", "gpt_oss"])
def test_small_layers_every_expert_type(fields):
    """Tiles as small as the shapes (embed 32: one full-width tile), each expert type."""
    cfg = MoeConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=64, capacity_factor=4.0,
                    dtype="bfloat16", param_dtype="bfloat16", **fields)
    check(relative_errors(cfg, 2, 32, 32))
