"""Layer patterns under nn.scan (models/layout.py): one period of blocks per scanned step (each
block its own parameters, ``layers/sub_j``), an unrolled prefix and rest; any pattern scans, and
scanned equals unrolled."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from shardzoo.models import decode as dec
from shardzoo.models import get_config
from shardzoo.models.arch import DENSE, FULL, MOE, SLIDING, LayerSpec
from shardzoo.models.layout import Layout, auto_layout
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


def test_layouts_scan_a_period_between_an_unrolled_prefix_and_rest():
    def specs(text):  # one letter a layer: L local, G global, D dense, M MoE
        return [LayerSpec(window=4 if c == "L" else None, mlp=MOE if c == "M" else DENSE) for c in text]

    assert auto_layout(specs("LLLLLG" * 4 + "LL")) == Layout(26, 0, 6, 4)  # Gemma 3 1B
    assert auto_layout(specs("LG" * 13)) == Layout(26, 0, 2, 13)  # Gemma 2
    assert auto_layout(specs("DDD" + "M" * 58)) == Layout(61, 3, 1, 58)  # DeepSeek V3's dense prefix
    assert auto_layout(specs("DDD" + "MD" * 3)) == Layout(9, 2, 2, 3)  # a prefix, a period, a rest
    assert auto_layout(specs("LLLGLLLG" + "LLLG")) == Layout(12, 0, 4, 3)
    assert auto_layout(specs("D")) == Layout(1, 0, 1, 1)  # one layer: a stack of one
    assert auto_layout(specs("DM")) == Layout(2, 2, 1, 0)  # nothing repeats: all unrolled
    lay = Layout(9, 2, 2, 3)
    assert lay.unrolled == (0, 1, 8) and lay.period_layers(1) == (3, 5, 7)
    assert lay.param_layout() == ([(("layers_0",), (0,), False), (("layers_1",), (1,), False)]
                                  + [(("layers", "sub_0"), (2, 4, 6), True), (("layers", "sub_1"), (3, 5, 7), True)]
                                  + [(("layers_8",), (8,), False)])


def test_a_legacy_layout_of_one_period_still_builds_and_names_its_parameters():
    """What shardzoo built for 8 Gemma 3 layers before the family layer (one period of 6, two
    unrolled): an explicit scan_layout, as its checkpoints now record it."""
    config = get_config("gemma3-tiny", scan_layout=(0, 6, 1), **TINY)
    assert config.param_layout() == (
        [(("layers", f"sub_{j}"), (j,), True) for j in range(6)]
        + [(("layers_6",), (6,), False), (("layers_7",), (7,), False)])
    assert [s.window for s in config.layer_specs()] == [4] * 5 + [None] + [4] * 2
    boxed = jax.eval_shape(config.build().init, jax.random.key(0), _tokens(0))["params"]
    assert set(boxed) == {"embed", "final_norm", "layers", "layers_6", "layers_7"}
    assert set(boxed["layers"]) == {f"sub_{j}" for j in range(6)}
    specs = nn.get_partition_spec(boxed)
    for j in range(6):  # every sub-block keeps its logical names, with the leading layers axis
        spec = specs["layers"][f"sub_{j}"]
        assert tuple(spec["attn"]["q"]["kernel"]) == (ax.LAYERS, ax.EMBED, ax.HEADS, ax.HEAD_DIM)
        assert tuple(spec["post_mlp_norm"]["scale"]) == (ax.LAYERS, ax.EMBED)
    assert tuple(specs["layers_6"]["attn"]["q"]["kernel"]) == (ax.EMBED, ax.HEADS, ax.HEAD_DIM)
    assert nn.unbox(boxed)["layers"]["sub_0"]["attn"]["q"]["kernel"].shape == (1, 32, 4, 8)
    assert get_config("gemma3-tiny", **TINY).layout() == Layout(8, 0, 1, 5)  # today's choice


# A mixed MoE pattern: 3 dense layers, then MoE every second layer: layers 0-1 unrolled, a
# period (MoE, dense) scanned 3 times, layer 8 unrolled.
MIXED = dict(TINY, num_hidden_layers=9, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             mlp_layer_types=("dense",) * 3 + ("moe", "dense") * 3, layer_types=None, sliding_window=4,
             attn_logit_softcapping=None, final_logit_softcapping=None, capacity_factor=4.0)


@functools.cache
def _mixed_params():
    """The scanned MIXED model's params, initialised once for the three tests that run it (its
    init is their dearest compile); the unrolled layout takes them through ``unrolled_params``."""
    return nn.unbox(_jit(get_config("qwen3-moe-tiny", **MIXED).build().init, jax.random.key(0), _tokens(1))["params"])


@pytest.mark.parametrize("name, fields", [("gemma3-tiny", TINY), ("qwen3-moe-tiny", MIXED)])
def test_scanned_and_unrolled_patterns_give_the_same_logits_and_gradients(name, fields):
    fields = {k: v for k, v in fields.items() if k not in ("query_pre_attn_scalar", "attn_logit_softcapping",
                                                           "final_logit_softcapping")} if name != "gemma3-tiny" else fields
    scanned = get_config(name, **fields)
    unrolled = get_config(name, scan_layers=False, **fields)
    assert scanned.layout().repeats and (name == "gemma3-tiny" or scanned.layout().prefix)
    x = _tokens(1)
    if name == "qwen3-moe-tiny":
        params = _mixed_params()
    else:
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
    flat_s = jax.tree_util.tree_leaves_with_path(unrolled_params(scanned, grads_s))
    flat_u = dict(jax.tree_util.tree_leaves_with_path(grads_u))
    assert len(flat_s) == len(flat_u)
    for path, got in flat_s:  # float32 sums in another order: 1e-5 of the array's own scale
        want = flat_u[path]
        scale = max(1.0, float(jnp.abs(want).max()))
        np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0, err_msg=str(path))
    for i in (0, 5, scanned.num_hidden_layers - 1):  # first, scanned and last layers all learn
        assert float(jnp.abs(grads_u[f"layers_{i}"]["attn"]["q"]["kernel"]).max()) > 0
    if name == "gemma3-tiny":
        assert float(jnp.abs(logits_s).max()) < 2.0  # the final cap holds


@pytest.mark.parametrize("scan", [False, True])
def test_cached_decoding_matches_full_forward(scan):
    """Prefill 5, then 11 steps through windows of 4 (and a global layer that sees all), in the
    unrolled and the scanned (prefix, period, rest) layouts."""
    config = get_config("qwen3-moe-tiny", scan_layers=scan, **dict(MIXED, moe_dispatch="dropless"))
    module = config.build()
    x = _tokens(2)
    params = _mixed_params() if scan else unrolled_params(get_config("qwen3-moe-tiny", **MIXED), _mixed_params())
    full = jax.jit(module.apply, compiler_options=FAST)({"params": params}, x)
    step = jax.jit(dec.decode_step, static_argnums=0, compiler_options=FAST)
    cache = jax.jit(dec.cache_init_fn(module, B, L))(params)
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
    jax.config.update("jax_enable_compilation_cache", False)

    def config(n):
        types = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n))
        return get_config("gemma3-tiny", **TINY, num_hidden_layers=n, layer_types=types)

    try:
        times = {n: min(_compile_seconds(config(n)) for _ in range(2)) for n in (12, 36)}
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
    assert times[36] < 1.5 * times[12], times


def test_flops_count_each_layer_with_its_own_window():
    """Local layers see at most ``sliding_window`` keys, global ones the whole causal prefix."""
    config = get_config("gemma3-tiny", **TINY)  # 7 local layers (window 4), 1 global
    seq, w = 64, TINY["sliding_window"]
    dense = get_config("gemma3-tiny", **dict(TINY, sliding_window=None, layer_types=None))
    attn = 12 * 4 * 8  # 12 x heads x head_dim, per key
    local_keys, global_keys = w - w * w / (2 * seq), seq / 2
    assert dense.flops_per_token(seq) - config.flops_per_token(seq) == pytest.approx(
        attn * 7 * (global_keys - local_keys))
