"""Pallas splash attention (interpret mode on the CPU) equals the XLA attention, fp32.

Kernel cases at batch 2, length 256 (two 128 blocks), 4 heads: its output and the gradients of
q, k, v against ``xla_attention`` with ``attention_mask`` (by position, packed rows restarting),
then whole tiny Transformers with attention_impl="splash" against "xla", one device and fsdp_tp.
Tolerance: 1e-5 times the reference's largest magnitude (at least 1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from shardzoo.models import ModelError, attention_kernels, get_model
from shardzoo.models.attention_kernels import attention_kernel, attention_mask, xla_attention
from shardzoo.models.splash import padded_width, shard_spec, splash_attention
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import Placement, activate, logical_shardings
from shardzoo.train.config import TrainConfig
from shardzoo.train.tasks.registry import run_program

B, L, H = 2, 256, 4


def close(a, b, what=""):
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * scale, err_msg=what)


def packed(seed, batch=B, length=L):
    """Segment ids 1, 2, ... (2-4 documents a row) and positions restarting at each."""
    rng = np.random.default_rng(seed)
    seg = np.sort(rng.integers(1, 5, (batch, length)), axis=1).astype(np.int32)
    starts = np.concatenate([np.ones((batch, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    idx = np.broadcast_to(np.arange(length), (batch, length))
    positions = (idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)).astype(np.int32)
    return jnp.asarray(seg), jnp.asarray(positions)


CASES = {  # name: (kv_heads, head_dim, packed rows, window, chunk, cap)
    "causal_mha": (4, 128, False, None, None, None),
    "segments_gqa": (2, 64, True, None, None, None),
    "mqa": (1, 64, True, None, None, None),
    "window": (2, 64, True, 48, None, None),
    "chunked": (2, 64, False, None, 64, None),
    "chunked_packed": (2, 64, True, None, 48, None),
    "softcap": (2, 64, True, None, None, 2.0),
    "padded_head_dim": (2, 80, True, None, None, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_splash_output_and_gradients_equal_xla(case):
    kv, dim, is_packed, window, chunk, cap = CASES[case]
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(B, L, n, dim)), jnp.float32) for n in (H, kv, kv))
    # unpacked rows at positions 10, 11, ...: chunks by position, not by index
    seg, positions = packed(2) if is_packed else (None, jnp.broadcast_to(jnp.arange(L) + 10, (B, L)))
    scale = 2.0 / dim ** 0.5  # logits large enough for the cap to clip
    probe = jnp.cos(0.1 * jnp.arange(B * L * H * dim, dtype=jnp.float32)).reshape(B, L, H, dim)

    def splash(q, k, v):
        out = splash_attention(q, k, v, seg, positions, scale=scale, sliding_window=window, chunk=chunk,
                               logit_cap=cap, interpret=True)
        return jnp.sum(out * probe), out

    def xla(q, k, v):
        mask = attention_mask(positions, positions, seg, seg, window, chunk)
        out = xla_attention(q, k, v, mask, scale, cap)
        return jnp.sum(out * probe), out

    (_, got), grads = jax.jit(jax.value_and_grad(splash, (0, 1, 2), has_aux=True))(q, k, v)
    (_, want), ref = jax.jit(jax.value_and_grad(xla, (0, 1, 2), has_aux=True))(q, k, v)
    close(got, want, "output")
    for name, a, b in zip("qkv", grads, ref, strict=True):
        close(a, b, f"d{name}")
    assert padded_width(dim) == (128 if dim == 80 else dim)


def test_auto_picks_splash_on_tpu_only_and_leaves_sinks_and_odd_lengths_to_xla(monkeypatch):
    _, llama = get_model("llama-tiny")
    _, oss = get_model("gpt-oss-tiny")
    f32 = jnp.dtype("float32")
    scores = lambda: llama.activation_estimate(2, 256, lambda names: 1).terms["scores"]  # noqa: E731
    assert attention_kernel(llama, f32, 256) == "xla" and scores() > 0  # CPU
    monkeypatch.setattr(attention_kernels.jax, "default_backend", lambda: "tpu")
    assert attention_kernel(llama, f32, 256) == "splash"
    assert scores() == 0  # the plan: splash keeps no scores
    assert attention_kernel(llama, f32, 200) == "xla"  # not a multiple of 128
    assert attention_kernel(oss, f32, 256) == "xla"  # sinks
    assert attention_kernel(llama.replace(attention_impl="xla"), f32, 256) == "xla"
    with pytest.raises(ModelError, match=r"attention_impl='splash': attention_sinks .* use 'auto' or 'xla'"):
        get_model("gpt-oss-tiny", attention_impl="splash")
    with pytest.raises(ModelError, match=r"attention_impl='splash': latent attention"):
        get_model("deepseek-v2-tiny", attention_impl="splash")


TINY = dict(num_hidden_layers=1, max_position_embeddings=256)
MODELS = {  # gemma2: a window of 8, a full layer, capped logits, head_dim 16 (padded); llama4: chunks of 4, NoPE
    "gemma2-tiny": dict(num_hidden_layers=2, layer_types=("sliding_attention", "full_attention")),
    "llama4-tiny": dict(num_hidden_layers=2, layer_types=("chunked_attention", "full_attention"),
                        mlp_layer_types=("dense", "dense"), rope_layers=(True, False), hidden_size=32,
                        intermediate_size=64),
}  # llama-tiny (GQA): the train step below


def _logits(module, params, seg, positions, tokens, placement=None):
    module = module if placement is None else module.clone(placement=placement)
    return jax.jit(lambda p: module.apply({"params": p}, tokens, positions, seg))(params)


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_transformer_with_splash_gives_xlas_logits(name):
    seg, positions = packed(3, length=128)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 128, (B, 128)), jnp.int32)
    xla_module, _ = get_model(name, attention_impl="xla", **TINY | MODELS[name])
    splash_module, config = get_model(name, attention_impl="splash", **TINY | MODELS[name])
    assert {s.window or s.chunk for s in config.layer_specs()} == {None, 8 if name == "gemma2-tiny" else 4}
    params = nn.unbox(jax.jit(xla_module.init)(jax.random.key(0), tokens)["params"])  # jit: not op by op
    want = _logits(xla_module, params, seg, positions, tokens)
    close(_logits(splash_module, params, seg, positions, tokens), want)
    assert float(jnp.std(want)) > 1e-2


def test_splash_under_fsdp_tp_equals_one_device_logits_and_gradients():
    """Eight devices (fsdp=4 over batch, tensor=2 over query and kv heads): the kernel in a shard_map."""
    seg, positions = packed(5, batch=4, length=128)
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, 128, (4, 128)), jnp.int32)
    module, _ = get_model("llama-tiny", attention_impl="splash", **TINY)
    boxed = jax.eval_shape(module.init, jax.random.key(0), tokens)["params"]
    params = jax.device_get(nn.unbox(jax.jit(module.init)(jax.random.key(0), tokens)["params"]))  # jit: not op by op

    def objective(module):
        def f(p):
            logits = module.apply({"params": p}, tokens, positions, seg)
            return jnp.mean(logits * jnp.cos(0.01 * jnp.arange(logits.size)).reshape(logits.shape)), logits
        return jax.jit(jax.value_and_grad(f, has_aux=True))

    (_, want), grads = objective(module)(params)
    mesh, rules = make_mesh("fsdp=4,tensor=2"), get_rules("fsdp_tp")
    with activate(mesh):
        placed = jax.device_put(params, logical_shardings(boxed, mesh, rules))
        compiled = objective(module.clone(placement=Placement(mesh, rules))).lower(placed).compile()
    (_, got), got_grads = compiled(placed)
    close(got, want, "logits")
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got_grads)[0], jax.tree.leaves(grads), strict=True):
        close(a, b, jax.tree_util.keystr(path))
    assert shard_spec(Placement(mesh, rules), 4, 4, 2) == P("fsdp", None, "tensor", None)
    assert shard_spec(Placement(mesh, rules), 4, 4, 1) == P("fsdp", None, None, None)  # MQA: heads whole


def test_train_step_loss_with_splash_equals_xla():
    """Two adamw steps of the program, remat keeping attn_context (the kernel's output)."""
    seg, positions = packed(7, length=128)
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, 128, (B, 129)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": np.asarray(positions),
             "segment_ids": np.asarray(seg), "weights": np.ones((B, 128), np.float32)}
    cfg = TrainConfig(batch_size=B, seq_len=128, lr=1e-2, warmup_steps=0, steps=2)

    def losses(impl):
        _, config = get_model("llama-tiny", attention_impl=impl, remat_policy="save_attn_mlp", **TINY)
        program = run_program(cfg, config, get_rules("dp"), make_mesh("data=1", devices=jax.devices()[:1]))
        state, step = program.init(jax.random.key(0)), program.compiled_train_step()
        out = []
        for _ in range(2):
            state, metrics = step(state, program.place(batch), jax.random.PRNGKey(1))
            out.append(float(metrics["loss"]))
        return np.array(out)

    xla = losses("xla")
    assert xla[1] != xla[0]
    np.testing.assert_allclose(losses("splash"), xla, rtol=0, atol=1e-5)


def _scanned_grads(policy, block_q=None):
    """Gradients of a 3-layer scan of splash attention under ``policy`` (q, k, v by name, as the
    Attention module names them) and the compiled program's while loops (the scan's and each
    interpreted kernel's)."""
    from jax.ad_checkpoint import checkpoint_name

    seg, pos = packed(5)

    def layer(x, w):
        q, k, v = (checkpoint_name(jnp.einsum("bld,dhe->blhe", x, w[i]), n)
                   for i, n in enumerate(("query", "key", "value")))
        out = splash_attention(q, k, v, seg, pos, scale=0.125, block_q=block_q)
        return x + out.reshape(x.shape), None

    def loss(ws, x):
        y, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, ws)
        return jnp.sum(y ** 2)

    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(B, L, H * 64)), jnp.float32)
    ws = jnp.asarray(rng.normal(size=(3, 3, H * 64, H, 64)) * 0.05, jnp.float32)
    step = jax.jit(jax.grad(loss))
    return step(ws, x), step.lower(ws, x).compile().as_text().count(" while(")


def test_save_qkv_mlp_keeps_the_kernels_residuals_so_the_backward_never_reruns_its_forward():
    from shardzoo.models.execution import REMAT_POLICIES

    names = jax.checkpoint_policies.save_only_these_names
    saved, loops = _scanned_grads(REMAT_POLICIES["save_qkv_mlp"])
    recomputed, loops_before = _scanned_grads(names("query", "key", "value"))
    # the forward scan, its kernel, the backward scan, its kernel; recomputing adds one more
    assert (loops, loops_before) == (4, 5)
    close(saved, recomputed, "gradients")
    tiled, _ = _scanned_grads(REMAT_POLICIES["save_qkv_mlp"], block_q=256)  # one 256-query tile a row
    close(tiled, recomputed, "block_q=256")


def test_splash_block_q_must_be_a_multiple_of_128():
    with pytest.raises(ModelError, match=r"splash_block_q=192 must be a multiple of 128"):
        get_model("llama-tiny", splash_block_q=192)


def test_plan_counts_the_kernels_residuals_where_save_qkv_mlp_keeps_them():
    """The plan's per-layer term: the kernel's output at its head width, float32 log-sum-exp."""
    _, cfg = get_model("llama-tiny", attention_impl="splash", remat_policy="save_qkv_mlp")
    est = cfg.activation_estimate(2, 256, lambda names: 1)
    heads, width = cfg.arch.num_attention_heads, padded_width(cfg.head_size)
    assert est.terms["attn_kernel"] == 2 * 256 * heads * (width * 4 + 4)  # float32 compute here
    _, xla = get_model("llama-tiny", attention_impl="xla", remat_policy="save_qkv_mlp")
    assert "attn_kernel" not in xla.activation_estimate(2, 256, lambda names: 1).terms
