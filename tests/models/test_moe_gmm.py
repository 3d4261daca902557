"""The grouped-matmul (megablox ``gmm``) MoE dispatch against the indexed one, in Pallas' interpret
mode on CPU, float32: the same outputs, gradients and losses with no token dropped (capacity
factor experts / k: every expert can take every token of a row), and ``auto``'s choice.

Rows outside every expert's group (padding, the row tile's remainder) are left unwritten by the
kernel; interpret mode fills them with NaN (checked below), so a missing mask shows as NaN here.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardzoo.models import get_model
from shardzoo.models.execution import Execution
from shardzoo.models.moe import MoeConfig, MoeMLP
from shardzoo.models.moe_dispatch import (
    GmmTiling,
    MoeError,
    gated_activation,
    gmm_dispatch,
    gmm_matmul,
    resolve_dispatch,
    sorted_dispatch,
)
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import Placement, activate
from shardzoo.train.config import TrainConfig
from shardzoo.train.optim import make_optimizer
from shardzoo.train.program import Program

E, K, D, M, B, L = 8, 2, 32, 64, 2, 32  # 64 tokens, 128 (token, expert) rows: one row tile
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
BASE = MoeConfig(num_experts=E, num_experts_per_tok=K, intermediate_size=M, capacity_factor=E / K,
                 aux_loss_coef=0.1, z_loss_coef=0.01)
CASES = {  # name: (MoeConfig fields, padded tokens)
    "gated": (dict(), False),
    "plain": (dict(expert_type="plain", hidden_act="relu2"), True),
    "gpt_oss": (dict(swiglu_limit=0.5, expert_bias=True, router_bias=True, norm_topk_prob=False), True),
    "sigmoid_input_scaled": (dict(router_kind="sigmoid_input", routed_scaling_factor=2.5, norm_topk_prob=False), True),
    # rows outside every group (biased experts): their gradients, which the kernel leaves unwritten, masked
    "biased_input_scaled": (dict(expert_bias=True, router_kind="sigmoid_input", norm_topk_prob=False), True),
    "zero_experts": (dict(zero_experts=2), True),  # LongCat-Flash's: their choices never computed
    "zero_experts_biased": (dict(zero_experts=2, expert_bias=True), True),
}


def make_params(cfg, seed=0):
    """Random params of the layer's own tree (biases too, so that they count)."""
    x = jnp.zeros((B, L, D))
    boxed = jax.eval_shape(MoeMLP(cfg).init, jax.random.key(0), x)["params"]
    r = np.random.default_rng(seed)
    return jax.tree.map(lambda a: r.normal(size=a.shape).astype(np.float32) / np.sqrt(a.shape[-2] if a.ndim > 1 else 4),
                        jax.tree.map(lambda b: b.unbox(), boxed, is_leaf=lambda b: hasattr(b, "unbox")))


def run(cfg, params, x, token_mask=None, placement=None):
    """(output, sown collections, d(<output, projection> + aux) / d(params, x)), jitted."""
    proj = jnp.asarray(np.random.default_rng(9).normal(size=x.shape).astype(np.float32))

    def loss(params, x):
        y, state = MoeMLP(cfg, placement).apply({"params": params}, x, token_mask=token_mask,
                                                mutable=["losses", "metrics"])
        return jnp.sum(y * proj) + state["losses"]["moe_aux_loss"][0], (y, state)

    (_, (y, state)), grads = jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, state, grads


def assert_trees_close(a, b, atol=1e-5):
    for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(u, v, atol=atol, rtol=0, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(1).normal(size=(B, L, D)).astype(np.float32)


MASK = np.arange(L)[None, :] < np.array([[L], [L - 11]])  # row 1 ends in 11 padding tokens


@pytest.mark.parametrize("case", list(CASES))
def test_gmm_equals_indexed_outputs_and_gradients(case, x):
    fields, padded = CASES[case]
    cfg = dataclasses.replace(BASE, **fields)
    params, mask = make_params(cfg), MASK if padded else None
    y_ref, s_ref, g_ref = run(dataclasses.replace(cfg, dispatch="indexed"), params, x, mask)
    y, s, g = run(dataclasses.replace(cfg, dispatch="gmm"), params, x, mask)
    assert float(s_ref["metrics"]["dropped_fraction"][0]) < 1e-6  # the reference drops nothing (zero experts: rounding)
    assert np.abs(y_ref).max() > 0.1
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=0)
    assert_trees_close(g, g_ref)  # input, router (and its bias), expert weights (and biases)
    assert_trees_close(s["losses"], s_ref["losses"])
    if padded and not cfg.zero_experts:  # padding takes no expert: 0 out, no gradient in (identity experts
        # pass every token through, padding too, in every dispatch)
        assert np.all(np.asarray(y)[~mask] == 0) and np.all(np.asarray(g[1])[~mask] == 0)


def test_unwritten_rows_are_nan_in_interpret_mode():
    """The premise of the masking tests: rows outside every group come back NaN (unwritten)."""
    out = gmm_matmul(GmmTiling(), True)(jnp.ones((128, 8)), jnp.ones((2, 8, 16)), jnp.array([50, 20], jnp.int32))
    assert np.all(np.asarray(out[:70]) == 8.0) and np.all(np.isnan(np.asarray(out[70:])))


def test_tiling_divides_the_shapes_and_partial_tiles_are_exact():
    t = GmmTiling()  # bfloat16's
    assert t(4096, 2048, 768) == (512, 1024, 768) and t(4096, 768, 2048) == (512, 768, 1024)
    assert GmmTiling(cols=512)(4096, 2048, 768) == (512, 512, 384)
    assert [t.row_multiple(n) for n in (1, 128, 300, 512, 513, 65536)] == [128, 128, 384, 512, 512, 512]
    assert t(128, 2880, 2880)[1:] == (1024, 1024)  # no multiple of 128 divides 2880: the kernel masks
    # such a partial tile: dims 200 and 136 in tiles of 128, forward and backward, against ragged_dot
    r = np.random.default_rng(0)
    lhs, rhs = r.normal(size=(256, 200)).astype(np.float32), r.normal(size=(3, 200, 136)).astype(np.float32)
    sizes, valid = jnp.array([60, 0, 130], jnp.int32), (np.arange(256) < 190)[:, None]

    def loss(matmul, lhs, rhs):
        return jnp.sum(jnp.where(valid, matmul(jnp.where(valid, lhs, 0), rhs, sizes), 0) ** 2)

    got = jax.value_and_grad(functools.partial(loss, gmm_matmul(GmmTiling(128, 128), True)), (0, 1))(lhs, rhs)
    want = jax.value_and_grad(functools.partial(loss, jax.lax.ragged_dot), (0, 1))(lhs, rhs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-4 * np.abs(b).max())


def test_wide_gmm_is_gmm_before_its_rounding_and_shares_its_backward():
    """``gmm_matmul(wide=True)`` on bfloat16 rows: the float32 output rounds to the bfloat16 one's,
    and for a cotangent a bfloat16 can hold its gradients are the bfloat16 output's, kernel for kernel."""
    r = np.random.default_rng(3)
    lhs = jnp.asarray(r.normal(size=(256, 64)), jnp.bfloat16)
    rhs = jnp.asarray(r.normal(size=(3, 64, 128)) / 8, jnp.bfloat16)
    sizes = jnp.array([100, 0, 156], jnp.int32)
    cot = jnp.asarray(r.normal(size=(256, 128)), jnp.bfloat16)
    narrow, wide = (gmm_matmul(GmmTiling(128, 128), True, wide=w) for w in (False, True))
    out_n, vjp_n = jax.vjp(lambda a, b: narrow(a, b, sizes), lhs, rhs)
    out_w, vjp_w = jax.vjp(lambda a, b: wide(a, b, sizes), lhs, rhs)
    assert out_n.dtype == jnp.bfloat16 and out_w.dtype == jnp.float32
    assert np.abs(np.asarray(out_w) - np.asarray(out_n, np.float32)).max() > 0  # not rounded
    np.testing.assert_array_equal(np.asarray(out_w.astype(jnp.bfloat16), np.float32), np.asarray(out_n, np.float32))
    for a, b in zip(vjp_w(cot.astype(jnp.float32)), vjp_n(cot), strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_clamped_experts_gradients_stay_near_float32_in_bfloat16():
    """GPT-OSS's clamp decided on the gate's float32 accumulation (``wide_hidden``, what MoeMLP asks
    for clamped experts): in bfloat16 the experts' gradients within 6e-3 of the float32 dropless
    reference (seen: 4e-3), where a bfloat16 gate and up (the clamp moved across its limits by rounding)
    stray over 4x further (seen: 9e-3 to 6e-2; on the chip the narrow gmm's 3.5e-2 against indexed's 4.8e-3)."""
    cfg = dataclasses.replace(BASE, **CASES["gpt_oss"][0])
    act = gated_activation(jax.nn.silu, cfg.swiglu_limit, cfg.swiglu_alpha)
    r = np.random.default_rng(0)
    x = np.asarray(jnp.asarray(r.normal(size=(B, L, D)), jnp.bfloat16), np.float32)  # the same numbers in both dtypes
    top_idx = jnp.asarray(np.stack([r.permutation(E)[:K] for _ in range(B * L)]).reshape(B, L, K), jnp.int32)
    top_p = jnp.asarray(r.dirichlet(np.ones(K), size=(B, L)), jnp.float32)
    weights = [r.normal(size=(E, D, M)) / np.sqrt(D), r.normal(size=(E, D, M)) / np.sqrt(D),
               r.normal(size=(E, M, D)) / np.sqrt(M)]
    biases = [r.normal(size=(E, M)) / 2, r.normal(size=(E, M)) / 2, r.normal(size=(E, D)) / 2]
    proj = jnp.asarray(r.normal(size=(B, L, D)), jnp.float32)

    def grads(dispatch, dtype):
        def loss(weights, biases):
            y = dispatch(jnp.asarray(x, dtype), top_idx, top_p, *weights, act, biases=biases)
            return jnp.sum(y.astype(jnp.float32) * proj)

        cast = [jnp.asarray(np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32), dtype) for w in weights + biases]
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(cast[:3], cast[3:])

    ref = grads(sorted_dispatch, jnp.float32)
    wide, narrow = (grads(functools.partial(gmm_dispatch, placement=None, wide_hidden=w), jnp.bfloat16)
                    for w in (True, False))
    err = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float32) - b) / np.linalg.norm(b))
    e_wide, e_narrow = ([err(got[0][i], ref[0][i]) for i in (0, 1)] for got in (wide, narrow))  # wi_gate, wi_up
    assert max(e_wide) < 6e-3 and max(e_narrow) > 4 * max(e_wide), (e_wide, e_narrow)


@pytest.mark.parametrize("case", ["gpt_oss", "gated"])
def test_gmm_on_a_mesh_equals_one_device(x, case):
    """shard_map over the tokens' mesh axes; mlp over tensor: the weights gathered whole (gated:
    padding's rows computed in the last group, decided outside the shard_map)."""
    cfg = dataclasses.replace(BASE, **CASES[case][0])
    params = make_params(cfg)
    want = run(dataclasses.replace(cfg, dispatch="indexed"), params, x, MASK)
    mesh = make_mesh("data=2,tensor=4")
    with activate(mesh):
        got = run(dataclasses.replace(cfg, dispatch="gmm"), params, x, MASK, Placement(mesh, get_rules("tp")))
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=0)
    assert_trees_close(got[2], want[2])


def test_auto_picks_gmm_only_on_a_tpu_with_whole_experts(monkeypatch):
    mesh = make_mesh("data=2,expert=4")
    ep, dp = Placement(mesh, get_rules("ep")), Placement(make_mesh("data=8"), get_rules("dp"))
    tp = Placement(make_mesh("data=2,tensor=4"), get_rules("tp"))
    assert resolve_dispatch("auto", None, "float32") == "indexed"  # this CPU
    assert resolve_dispatch("capacity", None, "float32") == "capacity"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_dispatch("auto", None, "bfloat16") == resolve_dispatch("auto", dp, "float32") == "gmm"
    assert resolve_dispatch("auto", ep, "bfloat16") == "indexed"  # experts split: XLA's all-to-all
    assert resolve_dispatch("auto", tp, "bfloat16") == "indexed"  # mlp split
    assert resolve_dispatch("auto", None, "float16") == "indexed"  # not megablox's
    assert resolve_dispatch("auto", None, "bfloat16", clamped=True) == "indexed"  # GPT-OSS's clamp
    assert resolve_dispatch("indexed", None, "bfloat16") == "indexed"
    # and the layer traces the kernel there (a trace only: no Mosaic compile on this CPU)
    cfg = dataclasses.replace(BASE, dispatch="auto")
    params, xs = make_params(cfg), jnp.zeros((B, L, D))
    text = str(jax.make_jaxpr(lambda p: MoeMLP(cfg).apply({"params": p}, xs))(params))
    assert "pallas_call" in text


def test_config_checks():
    assert Execution(moe_dispatch="gmm").moe_dispatch == "gmm" and Execution(moe_dispatch="auto")
    assert Execution().moe_dispatch == "indexed"  # the default stays (see models/moe.py's docstring)
    with pytest.raises(MoeError, match="dispatch='gmm' multiplies float32 or bfloat16, not dtype='float16'"):
        dataclasses.replace(BASE, dispatch="gmm", dtype="float16")


def _batch(rows=4, length=16):
    """Counting rows, the last one half padding (segment 0): the model's token mask."""
    ids = (np.random.default_rng(3).integers(0, 512, (rows, 1)) + np.arange(length + 1)) % 512
    seg = np.ones((rows, length), np.int32)
    seg[-1, length // 2:] = 0
    return {"inputs": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32),
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)),
            "segment_ids": seg, "weights": seg.astype(np.float32)}


OPTIMIZER = functools.partial(make_optimizer, TrainConfig(lr=1e-2, warmup_steps=0))


def test_tiny_moe_model_train_steps_equal_indexed():
    """qwen3-moe-tiny (a dense layer, then 4 experts top-2), two train steps of the one Program, one device."""
    losses = {}
    for dispatch in ("indexed", "gmm"):
        _, config = get_model("qwen3-moe-tiny", moe_dispatch=dispatch, capacity_factor=2.0)
        program = Program(config, get_rules("dp"), make_mesh("", devices=jax.devices()[:1]),
                          optimizer=OPTIMIZER, batch_size=4, seq_len=16)
        state, step = program.init(jax.random.key(0)), program.compiled_train_step()
        losses[dispatch] = []
        for _ in range(2):
            state, metrics = step(state, program.place(_batch()), np.zeros(2, np.uint32))
            losses[dispatch].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses["gmm"], losses["indexed"], rtol=0, atol=1e-5)
    assert losses["gmm"][1] < losses["gmm"][0] - 1e-3  # the first step moved the params


@pytest.mark.parametrize("dispatch", ["indexed", "gmm"])
def test_save_qkv_mlp_keeps_the_experts_gate_and_up_and_changes_no_gradient(dispatch, x):
    """The experts' gate and up projections carry the dense MLP's checkpoint names, so save_qkv_mlp
    keeps them (the backward reruns no expert matmul) and save_attn_mlp does not; the plan counts them."""
    import contextlib
    import io

    from shardzoo.models.costs import POLICY_TERMS
    from shardzoo.models.execution import REMAT_POLICIES

    cfg = dataclasses.replace(BASE, dispatch=dispatch)
    params = make_params(cfg)

    def loss(p, x):
        y, state = MoeMLP(cfg).apply({"params": p}, x, mutable=["losses", "metrics"])
        return jnp.sum(y * jnp.cos(x)) + state["losses"]["moe_aux_loss"][0]

    saved, grads = {}, {}
    for policy in ("save_qkv_mlp", "save_attn_mlp"):
        f = jax.checkpoint(loss, policy=REMAT_POLICIES[policy])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(f, params, x)
        saved[policy] = sorted(line.split(" named ")[1].split("'")[1] for line in out.getvalue().splitlines()
                               if " named " in line)
        grads[policy] = jit(jax.grad(f, argnums=(0, 1)))(params, x)
    assert saved == {"save_qkv_mlp": ["mlp_gate", "mlp_up"], "save_attn_mlp": []}
    assert_trees_close(grads["save_qkv_mlp"], jit(jax.grad(loss, argnums=(0, 1)))(params, x))
    assert_trees_close(grads["save_attn_mlp"], grads["save_qkv_mlp"])
    assert "expert_proj" in POLICY_TERMS["save_qkv_mlp"] and "expert_proj" not in POLICY_TERMS["save_attn_mlp"]
