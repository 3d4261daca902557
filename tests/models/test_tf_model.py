"""Transformer family: layer stacking, remat, packing, windows, rotary, presets' names and sizes."""

import contextlib
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from shardzoo.models import ModelError, get_config, get_model, list_models
from shardzoo.models.attention_kernels import causal_attention, softmax
from shardzoo.models.costs import buffers
from shardzoo.models.execution import REMAT_POLICIES
from shardzoo.models.hf.registry import PRESETS
from shardzoo.models.layers import project, swiglu
from shardzoo.models.rope import apply_rope, rope_inv_freq
from shardzoo.sharding import axes as ax
from shardzoo.sharding import get_rules, make_abstract_mesh, make_mesh
from shardzoo.sharding.partition import logical_shardings

TINY = dict(hidden_size=32, intermediate_size=64, vocab_size=128, max_position_embeddings=32)
B, L = 2, 16


def _tokens(seed, shape=(B, L), vocab=128):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


# Cheaper XLA:CPU compiles (about half the time); both sides of every comparison use them.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _jit(fn, *args):
    """Compile ``fn`` for ``args`` with FAST options and call it."""
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST)(*args)


def _init(module, x):
    return nn.unbox(_jit(module.init, jax.random.key(0), x)["params"])


def _loss(module):
    def loss(p, x):
        logits = module.apply({"params": p}, x)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    return loss


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny", "olmo2-tiny"])  # + qk-norms, post-norms
def test_scanned_and_unrolled_layers_agree(name):
    scanned, config = get_model(name, **TINY)
    unrolled, _ = get_model(name, scan_layers=False, **TINY)
    x = _tokens(1)
    params = _init(scanned, x)
    stack = params.pop("layers")
    per_layer = {f"layers_{i}": jax.tree.map(lambda a, i=i: a[i], stack)
                 for i in range(config.num_hidden_layers)}
    params_u = {**params, **per_layer}
    assert jax.tree.structure(params_u) == jax.tree.structure(_init(unrolled, x))

    cotangent = jax.random.normal(jax.random.key(9), (B, L, TINY["vocab_size"]))

    def logits_and_grads(module, p):  # gradients of sum(logits * cotangent)
        logits, vjp = jax.vjp(lambda p: module.apply({"params": p}, x), p)
        return logits, vjp(cotangent)[0]

    def both(ps, pu):
        return (*logits_and_grads(scanned, ps), *logits_and_grads(unrolled, pu))

    logits_s, grads_s, logits_u, grads_u = _jit(both, {**params, "layers": stack}, params_u)
    np.testing.assert_allclose(logits_s, logits_u, atol=1e-5, rtol=0)
    restacked = jax.tree.map(lambda *a: jnp.stack(a), *[grads_u[f"layers_{i}"] for i in range(2)])
    for got, want in zip(jax.tree.leaves(restacked), jax.tree.leaves(grads_s["layers"]), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # also within 1e-6 relative: values near 60, where 1e-5 is under three float32 ulps
    np.testing.assert_allclose(grads_u["embed"]["embedding"], grads_s["embed"]["embedding"], atol=1e-5, rtol=1e-6)
    assert float(jnp.abs(grads_s["layers"]["attn"]["q"]["kernel"]).max()) > 0


def test_fused_projections_run_apart_on_a_tpu(monkeypatch):
    """``fuse_projections`` stacks k|v and up|gate off a TPU only (layers.fuses; measured faster apart
    there): the trace on a "tpu" backend has no stacked kernel, and the plan counts no fused output."""
    from shardzoo.models.costs import transformer_activations
    from shardzoo.models.layers import fuses

    module, config = get_model("llama-tiny", attention_impl="xla", **TINY)
    x = _tokens(3)
    params = _init(module, x)
    jaxpr = lambda: str(jax.make_jaxpr(lambda p: module.apply({"params": p}, x))(params))  # noqa: E731
    terms = lambda: transformer_activations(config, B, L, lambda names: 1).terms  # noqa: E731
    fused = jaxpr()
    assert fuses(config.execution) and terms()["kv_proj"] > 0 and terms()["mlp_proj"] > 0
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert config.execution.fuse_projections and not fuses(config.execution)
    apart = jaxpr()  # a scanned layer's body: two more matmuls (k and v, up and gate), no stacked kernel
    assert apart.count("dot_general") == fused.count("dot_general") + 2, (apart.count("dot_general"), fused.count("dot_general"))
    assert terms()["kv_proj"] == 0 and terms()["mlp_proj"] == 0


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny", "gpt2-tiny"])
def test_fused_projections_equal_separate_ones(name):
    """k|v and up|gate as one stacked matmul: same parameters, logits (1e-5) and gradients (1e-5 and
    1e-6 relative)."""
    fused, config = get_model(name, fuse_projections=True, **TINY)
    separate, _ = get_model(name, fuse_projections=False, **TINY)
    x = _tokens(3)
    params = _init(separate, x)
    assert jax.tree.structure(_init(fused, x)) == jax.tree.structure(params)
    if config.attention_bias:  # the biases take part: make them non-zero
        params = jax.tree_util.tree_map_with_path(
            lambda path, a: a + 0.1 if "bias" in jax.tree_util.keystr(path) else a, params)
    cotangent = jax.random.normal(jax.random.key(9), (B, L, TINY["vocab_size"]))

    def logits_and_grads(module, p):
        logits, vjp = jax.vjp(lambda p: module.apply({"params": p}, x), p)
        return logits, vjp(cotangent)[0]

    (lf, gf), (ls, gs) = _jit(lambda p: (logits_and_grads(fused, p), logits_and_grads(separate, p)), params)
    np.testing.assert_allclose(lf, ls, atol=1e-5, rtol=0)
    for got, want in zip(jax.tree.leaves(gf), jax.tree.leaves(gs), strict=True):
        # gradients reach ~60 here, where 1e-5 is two float32 ulps: relative 1e-6 beside it
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-6)
    text = str(jax.make_jaxpr(lambda p: fused.apply({"params": p}, x))(params))
    assert text.count("dot_general") < str(
        jax.make_jaxpr(lambda p: separate.apply({"params": p}, x))(params)).count("dot_general")


@pytest.mark.parametrize("n_in, kernel_shape", [(1, (32, 4, 24)), (2, (4, 8, 24))])
def test_project_is_a_flat_matmul_on_one_cpu_device(n_in, kernel_shape):
    """project: tensordot's values and gradients (1e-5, and 1e-6 relative: gradients near 20); on
    one CPU device one 2-D matmul over the flattened tokens whose compiled backward copies and
    transposes nothing (tensordot's transposes the output's gradient and the kernel); on a mesh
    of several devices the leading dims stay apart."""
    x = jax.random.normal(jax.random.key(0), (2, 16) + kernel_shape[:n_in])
    kernel = jax.random.normal(jax.random.key(1), kernel_shape)
    cot = jax.random.normal(jax.random.key(2), (2, 16) + kernel_shape[n_in:])
    want = lambda x, k: jnp.tensordot(x, k, axes=n_in)  # noqa: E731
    np.testing.assert_allclose(project(x, kernel, n_in), want(x, kernel), atol=1e-5, rtol=0)
    for got, ref in zip(jax.vjp(lambda x, k: project(x, k, n_in), x, kernel)[1](cot),
                        jax.vjp(want, x, kernel)[1](cot), strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-6)

    def dots(fn):
        eqns = jax.make_jaxpr(fn)(x, kernel).eqns
        return [e.invars[0].aval.ndim for e in eqns if e.primitive.name == "dot_general"]

    assert dots(lambda x, k: project(x, k, n_in)) == [2]
    with jax.set_mesh(make_mesh("data=2", devices=jax.devices()[:2])):
        assert dots(lambda x, k: project(x, k, n_in)) == [x.ndim]

    def layout_ops(fn):  # the compiled backward's copies and transposes
        text = jax.jit(lambda x, k, g: jax.vjp(fn, x, k)[1](g)).lower(x, kernel, cot).compile().as_text()
        return re.findall(r"%(\S*(?:copy|transpose)\S*) = ", text[text.index("ENTRY"):])

    assert layout_ops(lambda x, k: project(x, k, n_in)) == []
    assert layout_ops(want)  # what the flat matmul spares


def test_swiglu_backward_equals_autodiff():
    gate, up, g = (jax.random.normal(jax.random.key(i), (4, 64)) * 3 for i in range(3))
    want = jax.vjp(lambda a, b: jax.nn.silu(a) * b, gate, up)[1](g)
    out, vjp = jax.vjp(swiglu, gate, up)
    np.testing.assert_allclose(out, jax.nn.silu(gate) * up, atol=1e-6, rtol=0)
    for got, ref in zip(vjp(g), want, strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-6)


def test_softmax_backward_equals_autodiff():
    x, g = (jax.random.normal(jax.random.key(i), (3, 5, 64)) * 4 for i in range(2))
    want = jax.vjp(lambda a: jax.nn.softmax(a, axis=-1), x)[1](g)[0]
    out, vjp = jax.vjp(softmax, x)
    np.testing.assert_allclose(out, jax.nn.softmax(x, axis=-1), atol=1e-7, rtol=0)
    np.testing.assert_allclose(vjp(g)[0], want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [None, 5])
def test_cpu_causal_attention_equals_jax_attention(window):
    """On CPU, causal_attention runs xla_attention: jax.nn.dot_product_attention's values and
    gradients (causal, packed segments, a window; 4 query heads over 2 kv heads)."""
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 12, h, 8)) for i, h in ((0, 4), (1, 2), (2, 2)))
    seg = jnp.asarray([[1] * 7 + [2] * 5, [1] * 12])

    def jax_attention(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=seg[:, None, :, None] == seg[:, None, None, :],
                                            scale=0.3, is_causal=True, implementation="xla",
                                            local_window_size=(window - 1, 0) if window else None)

    ours = lambda q, k, v: causal_attention(q, k, v, seg, window, 0.3, "xla")  # noqa: E731
    assert "custom_vjp_call" in str(jax.make_jaxpr(ours)(q, k, v))  # the CPU path, not jax's
    np.testing.assert_allclose(ours(q, k, v), jax_attention(q, k, v), atol=1e-6, rtol=1e-6)
    cot = jax.random.normal(jax.random.key(3), q.shape)
    for got, want in zip(jax.vjp(ours, q, k, v)[1](cot), jax.vjp(jax_attention, q, k, v)[1](cot), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_every_remat_policy_gives_the_same_gradients():
    x = _tokens(2)
    modules = {p: get_model("llama-tiny", remat_policy=p, **TINY)[0] for p in REMAT_POLICIES}
    params = _init(modules["none"], x)
    grad_fns = {p: jax.grad(_loss(m)) for p, m in modules.items()}
    for policy, fn in grad_fns.items():  # remat is really applied (and the names exist)
        text = str(jax.make_jaxpr(fn)(params, x))
        assert ("checkpoint" in text or "remat" in text) == (policy != "none"), policy
    assert "name=attn_context" in text and "name=mlp_hidden" in text
    grads = _jit(lambda p: {k: f(p, x) for k, f in grad_fns.items()}, params)
    for policy in REMAT_POLICIES:
        for got, want in zip(jax.tree.leaves(grads[policy]), jax.tree.leaves(grads["none"]), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=policy)


def _saved_residuals(fn, *args) -> list[tuple[str, tuple[int, ...]]]:
    """(what, shape) of each residual ``jax.grad`` of ``fn`` keeps, from print_saved_residuals."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    found = []
    for line in out.getvalue().splitlines():
        dtype, dims, what = re.match(r"(\w+)\[([\d,]*)\] (.*)", line).groups()
        found.append((what, tuple(int(d) for d in dims.split(",") if d)))
    return found


def test_every_remat_policy_saves_what_it_says():
    # Big enough that activations dominate: 2 scanned layers, batch 4 x 48 tokens, width 32, MLP 256.
    sizes = dict(TINY, max_position_embeddings=64, intermediate_size=256, num_hidden_layers=2)
    x = _tokens(5, (4, 48))
    params, residuals, temp = None, {}, {}
    for policy in REMAT_POLICIES:
        module, cfg = get_model("llama-tiny", remat_policy=policy, **sizes)
        params = params or _init(module, x)
        loss = _loss(module)
        saved = [r for r in _saved_residuals(loss, params, x) if "from the argument" not in r[0]]
        residuals[policy] = {
            "bytes": sum(4 * math.prod(shape) for _, shape in saved),  # all float32 / int32
            # per-layer residuals the layer scan stacks: [layers, ...]
            "stacked": {shape for what, shape in saved if "output of scan" in what and shape[0] == 2},
        }
        compiled = jax.jit(jax.grad(loss)).lower(params, x).compile(compiler_options=FAST)
        temp[policy] = compiled.memory_analysis().temp_size_in_bytes
    n, b, length = cfg.num_hidden_layers, 4, 48
    block_in = (n, b, length, cfg.hidden_size)
    attn_context = (n, b, length, cfg.num_attention_heads, cfg.head_size)
    mlp_hidden = (n, b, length, cfg.intermediate_size)
    stacked = {p: r["stacked"] for p, r in residuals.items()}
    assert stacked["full"] == {block_in}  # nothing inside a layer: only its input
    assert stacked["save_attn_mlp"] == {block_in, attn_context, mlp_hidden}  # exactly the two names
    kv = (n, b, length, cfg.arch.kv_heads, cfg.head_size)
    assert stacked["save_qkv_mlp"] == {block_in, attn_context, kv, mlp_hidden}  # q, k = v, gate = up
    assert stacked["save_qkv"] == {block_in, attn_context, kv}  # q, k = v: the MLP recomputed
    # Matmul outputs: projections (no batch dims; on one CPU device over the tokens flattened,
    # layers.project) under both dots policies; the attention scores [..., length, length] (a
    # dot with batch dims) only under dots_saveable.
    assert stacked["dots_with_no_batch_dims_saveable"] < stacked["dots_saveable"]
    assert (n, b * length, cfg.num_attention_heads * cfg.head_size) in stacked["dots_with_no_batch_dims_saveable"]
    scores = [s for s in stacked["dots_saveable"] if s.count(length) == 2]  # [.., length, .., length]
    assert scores and not any(s.count(length) == 2 for s in stacked["dots_with_no_batch_dims_saveable"])
    # save_qkv keeps less than save_attn_mlp: q, k and v against attention's context and the MLP's width
    order = ["none", "dots_saveable", "dots_with_no_batch_dims_saveable", "save_qkv_mlp", "save_attn_mlp", "save_qkv",
             "full"]
    saved_bytes = [residuals[p]["bytes"] for p in order]
    assert saved_bytes == sorted(saved_bytes, reverse=True) and len(set(saved_bytes)) == 7, saved_bytes
    # XLA's compiled scratch memory of the gradient follows (ties allowed at the end; the two
    # middle policies, within 3% of each other, in either order: XLA's choice, not the model's).
    temps = [temp[p] for p in order]
    middle = (temp["dots_with_no_batch_dims_saveable"], temp["save_qkv_mlp"])
    assert temps[0] > temps[1] > max(middle) and min(middle) >= temps[-2] >= temps[-1], temps
    assert max(middle) < 1.03 * min(middle), temps
    assert temps[0] > 1.5 * temps[-1], temps


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_packed_documents_do_not_see_each_other(name):
    module, _ = get_model(name, **TINY)
    a, b, filler = _tokens(3, (7,)), _tokens(4, (9,)), _tokens(5, (9,))
    # rows: a|b packed, b|a packed, a alone (then filler), b alone (then filler), a|b unpacked
    rows = ([a, b], [b, a], [a, filler], [b, filler[:7]], [a, b])
    x = jnp.stack([jnp.concatenate(r) for r in rows])
    seg = np.ones((5, L), np.int32)
    seg[0, 7:], seg[1, 9:] = 2, 2
    pos = np.tile(np.arange(L), (5, 1))
    pos[0, 7:], pos[1, 9:] = np.arange(9), np.arange(7)
    params = _init(module, x)
    logits = _jit(lambda p: module.apply({"params": p}, x, positions=pos, segment_ids=seg), params)
    alone_a, alone_b = logits[2, :7], logits[3, :9]
    np.testing.assert_allclose(logits[0, :7], alone_a, atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[0, 7:], alone_b, atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[1, :9], alone_b, atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[1, 9:], alone_a, atol=1e-5, rtol=0)
    assert float(jnp.abs(logits[4, 7:] - alone_b).max()) > 1e-3  # unpacked, b sees a


def test_sliding_window_follows_mistral_semantics():
    """A query at i attends keys j with i - j < w: over 2 layers token 0 reaches i <= 2w - 2."""
    w = 4
    module, _ = get_model("mistral-tiny", sliding_window=w, **TINY)
    x = _tokens(6, (1, L))
    x = jnp.concatenate([x, x.at[0, 0].set((x[0, 0] + 1) % 128)])
    logits = _jit(lambda p: module.apply({"params": p}, x), _init(module, x))
    changed = np.abs(np.asarray(logits[0] - logits[1])).max(axis=-1) > 1e-6
    np.testing.assert_array_equal(changed, np.arange(L) <= 2 * w - 2)


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = get_config("llama3.2-1b")
    hf = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                     head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling_dict,
                     max_position_embeddings=cfg.max_position_embeddings)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = rope_inv_freq(cfg.arch)
    plain = rope_inv_freq(get_config("llama3.2-1b", rope_scaling=None).arch)
    assert ours.dtype == np.float32 and not np.allclose(ours, plain)  # the scaling acts
    # Two libraries round differently: within 4 float32 ulps (another x86 machine showed 1 ulp on 7 of 32).
    np.testing.assert_array_max_ulp(ours, want.numpy().astype(np.float32), maxulp=4)


def test_rope_is_hf_rotate_half_and_partial():
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = get_config("llama-tiny", partial_rotary_factor=0.5)
    inv = rope_inv_freq(cfg.arch)  # 4 frequencies: rotates 8 of the 16 features
    q = np.random.default_rng(0).normal(size=(1, 5, 2, 16)).astype(np.float32)
    pos = np.arange(5)[None]
    freqs = pos[..., None] * inv
    emb = torch.tensor(np.concatenate([freqs, freqs], -1))
    rot = torch.tensor(q[..., :8]).transpose(1, 2)
    want, _ = apply_rotary_pos_emb(rot, rot, emb.cos(), emb.sin())
    got = np.asarray(apply_rope(jnp.asarray(q), jnp.asarray(pos), inv))
    np.testing.assert_allclose(got[..., :8], want.transpose(1, 2).numpy(), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(got[..., 8:], q[..., 8:])


# Parameter counts Hugging Face reports for the published checkpoints.
PUBLISHED = {
    "llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248, "llama3.1-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400, "mistral-7b": 7_241_732_096, "qwen2.5-0.5b": 494_032_768,
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "mixtral-8x7b": 46_702_792_704,
    "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360, "olmo-2-1b": 1_484_916_736,
    "phi-3-mini-4k": 3_821_079_552, "phi-3.5-mini": 3_821_079_552, "gemma-2b": 2_506_172_416, "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984, "gemma-3-1b": 999_885_952, "smollm3-3b": 3_075_098_624,
    "deepseek-v2-lite": 15_706_484_224, "deepseek-v3": 671_026_404_352,
}


def test_every_preset_names_every_dimension_and_has_its_published_size():
    assert set(PRESETS) <= set(list_models())
    for name in PRESETS:
        module, config = get_model(name)
        boxed = jax.eval_shape(module.init, jax.random.key(0), *config.sample_inputs(1, 4))["params"]
        specs = jax.tree.leaves(nn.get_partition_spec(boxed), is_leaf=lambda s: isinstance(s, tuple))
        leaves = jax.tree.leaves(nn.unbox(boxed))
        assert len(specs) == len(leaves)
        for spec, leaf in zip(specs, leaves, strict=True):
            assert len(spec) == leaf.ndim and set(spec) <= set(ax.ALL), (name, spec, leaf.shape)
        # DeepSeek-V3's router correction bias and xIELU's beta and eps are buffers to transformers: not counted
        counted = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(nn.unbox(boxed))
                   if tuple(k.key for k in path[-2:]) not in buffers(config.arch)]
        assert config.num_params() == sum(math.prod(a.shape) for a in counted), name
        if name in PUBLISHED:
            assert config.num_params() == PUBLISHED[name], name


def test_llama3_8b_bytes_per_device_on_64_device_fsdp_tp():
    module, config = get_model("llama3-8b")
    boxed = jax.eval_shape(module.init, jax.random.key(0), *config.sample_inputs(1, 4))["params"]
    shardings = logical_shardings(boxed, make_abstract_mesh("fsdp=8,tensor=8"), get_rules("fsdp_tp"))
    shapes = nn.unbox(boxed)

    def per_device(*path):
        sharding, leaf = shardings, shapes
        for key in path:
            sharding, leaf = sharding[key], leaf[key]
        return math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize

    f32 = 4
    assert per_device("layers", "attn", "q", "kernel") == 32 * (4096 // 8) * (32 // 8) * 128 * f32
    assert per_device("layers", "attn", "k", "kernel") == 32 * (4096 // 8) * (8 // 8) * 128 * f32
    assert per_device("layers", "mlp", "down", "kernel") == 32 * (14336 // 8) * (4096 // 8) * f32
    assert per_device("embed", "embedding") == (128256 // 8) * (4096 // 8) * f32
    assert per_device("lm_head", "kernel") == (4096 // 8) * (128256 // 8) * f32
    assert per_device("final_norm", "scale") == (4096 // 8) * f32


def test_config_errors_and_moe_layer_pattern():
    with pytest.raises(ModelError, match="num_key_value_heads=3"):
        get_config("llama-tiny", num_key_value_heads=3)
    with pytest.raises(ModelError, match="mlp_layer_types must name 2 layers"):
        get_config("mixtral-tiny", mlp_layer_types="dense,moe,moe")
    with pytest.raises(ModelError, match="remat_policy"):
        get_config("llama-tiny", remat_policy="sometimes")
    module, config = get_model("mixtral-tiny", mlp_layer_types="dense,moe")  # scanned: each alone
    boxed = jax.eval_shape(module.init, jax.random.key(0), *config.sample_inputs(1, 4))["params"]
    assert "mlp" in boxed["layers_0"] and "moe" not in boxed["layers_0"]
    assert "moe" in boxed["layers_1"] and "mlp" not in boxed["layers_1"]
    assert config.num_params() == sum(math.prod(a.shape) for a in jax.tree.leaves(nn.unbox(boxed)))


@pytest.mark.parametrize("field, value", [
    ("hidden_act", "foo"), ("mlp_type", "swiglu"), ("position_embedding", "xpos"), ("norm_type", "batch"),
    ("remat_policy", "sometimes"), ("attention_impl", "flash"), ("dtype", "float8"),
    ("param_dtype", "int8"), ("moe_dispatch", "sorted"), ("decode_layers", "scanned"), ("hidden_size", 0),
    ("num_hidden_layers", 0), ("num_attention_heads", 0), ("intermediate_size", -1), ("vocab_size", 0),
    ("num_key_value_heads", 0), ("head_dim", 0), ("rope_scaling", "foo"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), ("rope_scaling", {"rope_type": "linear"}),
    ("initializer_range", float("nan")), ("rms_norm_eps", -1e-6), ("rope_theta", 0.0),
    ("lora_alpha", float("inf")), ("scan_layout", (0, 3, 1)),
])
def test_every_bad_config_value_is_a_model_error_naming_its_field(field, value):
    with pytest.raises(ModelError, match=field):
        get_config("llama-tiny", **{field: value})
    if isinstance(value, str) and field != "rope_scaling":  # as the command line gives it
        with pytest.raises(ModelError, match=f"{field}='{value}'"):
            get_config("llama-tiny", **{field: str(value)})


def test_moe_and_mlp_configs_check_their_fields_when_built():
    from shardzoo.models.mlp import MLPConfig
    from shardzoo.models.moe import MoeConfig

    for field, value in (("hidden_act", "foo"), ("dtype", "float8"), ("param_dtype", "x"),
                         ("num_experts", 0), ("intermediate_size", 0), ("num_experts_per_tok", 0)):
        with pytest.raises(ModelError, match=f"MoeConfig.{field}="):
            MoeConfig(**{field: value})
    for field, value in (("activation", "foo"), ("dtype", "float8"), ("param_dtype", "x"),
                         ("task", "ranking"), ("width", 0)):
        with pytest.raises(ModelError, match=f"MLP(Arch|Execution).{field}="):
            MLPConfig.from_fields(**{field: value})
    with pytest.raises(ModelError, match="num_experts_per_tok=3"):  # the MoE layer's check, at build
        get_config("mixtral-tiny", num_local_experts=2, num_experts_per_tok=3)
