"""Local/global layer patterns under nn.scan: one period of blocks per scanned step (each block
its own parameters, ``layers/sub_j``), the layers past the last whole period unrolled."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from shardzoo.models import decode as dec
from shardzoo.models import get_config
from shardzoo.sharding import axes as ax

# gemma3-tiny: 8 layers, every 6th global; a window of 4 (shorter than the text), soft-caps on
# (the plain-XLA attention), qk-norm, a local rotary base and a scaled global one.
TINY = dict(hidden_size=32, intermediate_size=64, vocab_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
            attn_logit_softcapping=1.0, final_logit_softcapping=2.0)
B, L, PREFILL = 2, 16, 5
# Cheaper XLA:CPU compiles (about half the time); both sides of every comparison use them.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _jit(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST)(*args)


def _tokens(seed, vocab=128):
    return jax.random.randint(jax.random.key(seed), (B, L), 0, vocab)


def unrolled_params(config, params):
    """A scanned model's params in the unrolled layout (``layers_0`` ... ``layers_{n-1}``)."""
    out = {k: v for k, v in params.items() if k != "layers" and not k.startswith("layers_")}
    for prefix, layers, stacked in config.param_layout():
        tree = params
        for key in prefix:
            tree = tree[key]
        for k, i in enumerate(layers):
            out[f"layers_{i}"] = jax.tree.map(lambda a, k=k: a[k], tree) if stacked else tree
    return out


def test_eight_layers_at_period_six_scan_one_period_and_unroll_two():
    config = get_config("gemma3-tiny", **TINY)
    assert (config.num_hidden_layers, config.layer_period) == (8, 6)
    assert config.param_layout() == (
        [(("layers", f"sub_{j}"), (j,), True) for j in range(6)]
        + [(("layers_6",), (6,), False), (("layers_7",), (7,), False)])
    assert [config.is_local_layer(i) for i in range(8)] == [True] * 5 + [False] + [True] * 2
    boxed = jax.eval_shape(config.build().init, jax.random.key(0), _tokens(0))["params"]
    assert set(boxed) == {"embed", "final_norm", "layers", "layers_6", "layers_7"}
    assert set(boxed["layers"]) == {f"sub_{j}" for j in range(6)}
    specs = nn.get_partition_spec(boxed)
    q = ("attn", "q", "kernel")
    for j in range(6):  # every sub-block keeps its logical names, with the leading layers axis
        spec = specs["layers"][f"sub_{j}"]
        assert tuple(spec["attn"]["q"]["kernel"]) == (ax.LAYERS, ax.EMBED, ax.HEADS, ax.HEAD_DIM)
        assert tuple(spec["post_mlp_norm"]["scale"]) == (ax.LAYERS, ax.EMBED)
    assert tuple(specs["layers_6"]["attn"]["q"]["kernel"]) == (ax.EMBED, ax.HEADS, ax.HEAD_DIM)
    assert nn.unbox(boxed)["layers"]["sub_0"][q[0]][q[1]][q[2]].shape == (1, 32, 4, 8)


def test_scanned_and_unrolled_patterns_give_the_same_logits_and_gradients():
    scanned = get_config("gemma3-tiny", **TINY)
    unrolled = get_config("gemma3-tiny", scan_layers=False, **TINY)
    x = _tokens(1)
    params = nn.unbox(_jit(scanned.build().init, jax.random.key(0), x)["params"])
    params_u = unrolled_params(scanned, params)
    shapes_u = jax.eval_shape(unrolled.build().init, jax.random.key(0), x)["params"]
    assert jax.tree.structure(params_u) == jax.tree.structure(nn.unbox(shapes_u))
    cotangent = jax.random.normal(jax.random.key(9), (B, L, TINY["vocab_size"]))

    def logits_and_grads(module, p):  # gradients of sum(logits * cotangent)
        logits, vjp = jax.vjp(lambda p: module.apply({"params": p}, x), p)
        return logits, vjp(cotangent)[0]

    def both(ps, pu):
        return (*logits_and_grads(scanned.build(), ps), *logits_and_grads(unrolled.build(), pu))

    logits_s, grads_s, logits_u, grads_u = _jit(both, params, params_u)
    np.testing.assert_allclose(logits_s, logits_u, atol=1e-5, rtol=0)
    assert float(jnp.abs(logits_s).max()) < 2.0  # the final cap holds
    flat_s = jax.tree_util.tree_leaves_with_path(unrolled_params(scanned, grads_s))
    flat_u = dict(jax.tree_util.tree_leaves_with_path(grads_u))
    assert len(flat_s) == len(flat_u)
    for path, got in flat_s:
        np.testing.assert_allclose(got, flat_u[path], atol=1e-5, rtol=0, err_msg=str(path))
    for i in (0, 5, 7):  # local, global and remainder layers all learn
        assert float(jnp.abs(grads_u[f"layers_{i}"]["attn"]["q"]["kernel"]).max()) > 0


def test_unrolled_cached_decoding_matches_full_forward():
    """Prefill 5, then 11 steps through windows of 4 (and a global layer that sees all). The
    scanned layout decodes in tests/hf/test_hf_gemma.py (greedy tokens equal transformers')."""
    config = get_config("gemma3-tiny", scan_layers=False, **TINY)
    module = config.build()
    x = _tokens(2)
    params = nn.unbox(jax.jit(module.init, compiler_options=FAST)(jax.random.key(0), x)["params"])
    full = jax.jit(module.apply, compiler_options=FAST)({"params": params}, x)
    step = jax.jit(dec.decode_step, static_argnums=0, compiler_options=FAST)
    cache = dec.init_cache(module, params, B, L)
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    logits, cache = step(module, params, cache, x[:, :PREFILL], pos[:, :PREFILL])
    outs = [logits]
    for i in range(PREFILL, L):
        logits, cache = step(module, params, cache, x[:, i:i + 1], pos[:, i:i + 1])
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-5, rtol=0)


def _compile_seconds(config) -> float:
    """CPU seconds to lower and compile the forward pass of ``config``."""
    module, x = config.build(), _tokens(3)
    params = jax.eval_shape(lambda: nn.unbox(module.init(jax.random.key(0), x)["params"]))

    def forward(p, x):  # a new function each call: nothing traced before is reused
        return module.apply({"params": p}, x)

    start = time.process_time()  # CPU seconds of every thread: less noise from other processes
    jax.jit(forward).lower(params, x).compile(compiler_options=FAST)
    return time.process_time() - start


def test_compile_time_stays_flat_in_depth():
    """A Gemma-3-like pattern (period 6): 36 layers compile within 1.5x of 12 (the min of two
    tries each, the persistent compilation cache off)."""
    base = dict(TINY, sliding_window_pattern=6)
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        times = {n: min(_compile_seconds(get_config("gemma3-tiny", **base, num_hidden_layers=n))
                        for _ in range(2)) for n in (12, 36)}
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
    assert times[36] < 1.5 * times[12], times


def test_flops_count_each_layer_with_its_own_window():
    """Local layers see at most ``sliding_window`` keys, global ones the whole causal prefix."""
    config = get_config("gemma3-tiny", **TINY)  # 7 local layers (window 4), 1 global
    seq, w = 64, TINY["sliding_window"]
    dense = get_config("gemma3-tiny", **dict(TINY, sliding_window=None))
    attn = 12 * 4 * 8  # 12 x heads x head_dim, per key
    local_keys, global_keys = w - w * w / (2 * seq), seq / 2
    assert dense.flops_per_token(seq) - config.flops_per_token(seq) == pytest.approx(
        attn * 7 * (global_keys - local_keys))
