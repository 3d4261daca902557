"""The Pallas decoding kernel (``models/decode_attention.py``, interpret mode on the CPU) equals the
XLA path, fp32.

Kernel cases: 3 rows, a cache of 64 slots in blocks of 16, the query at slot ``index``; the slots
past it (and the whole blocks before a window's or chunk's first) hold NaN for the kernel and
zeros for the reference, so a block read or attended that should not be shows as NaN. Reference:
``xla_attention`` over the unpacked cache with ``attention_mask`` (and ``one_query_attention``, the
path the kernel replaces, where the logits are not capped). Then ``Program.generate`` and
``decode_step`` of tiny models with ``decode_attention="pallas"`` against "xla". Tolerance: 1e-5
times the reference's largest magnitude (at least 1).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardzoo.models import ModelError, get_model
from shardzoo.models import attention as attention_module
from shardzoo.models import decode as dec
from shardzoo.models import decode_attention as da
from shardzoo.models.attention_kernels import (
    attention_mask,
    one_query_attention,
    unpacked,
    xla_attention,
)
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.program import Program

B, L, BLOCK = 3, 64, 16


def close(a, b, what=""):
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * scale, err_msg=what)


CASES = {  # name: (heads, kv_heads, head_dim, pack, index, left padding per row, window, chunk, cap, keys_t)
    "causal_mha": (4, 4, 32, 1, 37, (0, 0, 0), None, None, None, False),
    "left_padded_gqa": (8, 2, 32, 1, 41, (0, 5, 20), None, None, None, False),  # row 2: block 0 all padding
    "mqa": (4, 1, 32, 1, 30, (0, 3, 0), None, None, None, False),
    "query_first_in_its_block": (4, 2, 32, 1, 48, (0, 2, 0), None, None, None, False),
    "query_last_slot": (4, 2, 32, 1, 63, (0, 0, 9), None, None, None, False),
    "query_first_slot": (4, 2, 32, 1, 0, (0, 0, 0), None, None, None, False),
    "sliding_window": (8, 2, 32, 1, 45, (0, 4, 0), 10, None, None, False),  # blocks 0 and 1 never read
    "chunked": (4, 2, 32, 1, 50, (0, 0, 0), None, 24, None, False),  # chunk from 48: block 3 only
    "packed_gqa": (8, 4, 32, 2, 39, (0, 6, 0), None, None, None, False),  # two kv heads per 64-wide row
    "packed_four": (8, 4, 32, 4, 22, (1, 0, 17), None, None, None, False),  # the TPU's 128 // 32
    "softcap": (4, 2, 32, 1, 33, (0, 7, 0), None, None, 2.0, False),
    "keys_transposed": (8, 2, 32, 2, 29, (0, 3, 0), None, None, None, True),
}


def _case(name):
    heads, kv, dim, pack, index, pads, window, chunk, cap, keys_t = CASES[name]
    rng = np.random.default_rng(len(name))
    q = jnp.asarray(rng.normal(size=(B, 1, heads, dim)), jnp.float32)
    k, v = (rng.normal(size=(B, kv // pack, L, pack * dim)).astype(np.float32) for _ in range(2))
    seg = (np.arange(L)[None, :] >= np.array(pads)[:, None]).astype(np.int32)  # 0 on the left padding
    slots = jnp.broadcast_to(jnp.arange(L), (B, L))
    mask = attention_mask(jnp.full((B, 1), index), slots, jnp.ones((B, 1), jnp.int32), jnp.asarray(seg), window, chunk)
    first = (max(index - window + 1 if window else 0, index // chunk * chunk if chunk else 0)) // BLOCK * BLOCK
    garbage = (np.arange(L) > index) | (np.arange(L) < first)  # never written, or in a block never read
    k_in, v_in = (np.where(garbage[None, None, :, None], np.nan, x) for x in (k, v))
    k, v = (np.where(garbage[None, None, :, None], 0.0, x) for x in (k, v))
    if keys_t:
        k, k_in = np.swapaxes(k, 2, 3), np.swapaxes(k_in, 2, 3)
    return (q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(k_in), jnp.asarray(v_in), mask, index,
            dict(window=window, chunk=chunk, logit_cap=cap, keys_t=keys_t))


def _kernel(q, k, v, mask, index, kw, batch_block):
    fn = lambda q, k, v, mask: da.one_query_pallas(q, k, v, mask, index, 0.7, block=BLOCK,  # noqa: E731
                                                     batch_block=batch_block, interpret=True, **kw)
    return jax.jit(fn)(q, k, v, mask)


def _reference(q, k, v, mask, kw):
    dim = q.shape[-1]
    k_rows = unpacked(k, dim, kw["keys_t"])
    return xla_attention(q, k_rows, unpacked(v, dim), mask, 0.7, kw["logit_cap"])


@pytest.mark.parametrize("batch_block", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_xla_and_never_reads_past_the_fill(case, batch_block):
    q, k, v, k_in, v_in, mask, index, kw = _case(case)
    got = _kernel(q, k_in, v_in, mask, index, kw, batch_block)
    assert not np.isnan(np.asarray(got)).any()
    close(got, _reference(q, k, v, mask, kw), case)
    if kw["logit_cap"] is None:
        close(got, one_query_attention(q, k, v, mask, 0.7, kw["keys_t"]), f"{case}: one_query_attention")


@pytest.mark.parametrize("case", ["packed_gqa", "sliding_window", "keys_transposed"])
def test_kernel_reads_its_layer_of_a_stack_and_nothing_else(case):
    """``layer``: k and v with a leading layers axis (a scanned stack's), the other layers NaN."""
    q, k, v, k_in, v_in, mask, index, kw = _case(case)
    stack = lambda x: jnp.stack([jnp.full_like(x, jnp.nan), x, jnp.full_like(x, jnp.nan)])  # noqa: E731
    fn = lambda q, k, v, mask, layer: da.one_query_pallas(q, k, v, mask, index, 0.7, block=BLOCK, layer=layer,  # noqa: E731
                                                          interpret=True, **kw)
    close(jax.jit(fn)(q, stack(k_in), stack(v_in), mask, jnp.int32(1)), _reference(q, k, v, mask, kw), case)


def test_kernel_with_its_own_blocks_of_128():
    """The default block (``block_k``: 128 of a 384-slot cache) and rows (``block_b``), 128-wide
    rows (four packed kv heads of 32), as on the chip; NaN past the query's slot."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.normal(size=(2, 1, 8, 32)), jnp.float32)
    k, v = (rng.normal(size=(2, 1, 384, 128)).astype(np.float32) for _ in range(2))
    mask = attention_mask(jnp.full((2, 1), 300), jnp.broadcast_to(jnp.arange(384), (2, 384)), jnp.ones((2, 1), jnp.int32),
                          jnp.asarray(np.arange(384)[None, :] >= np.array([[0], [40]]), jnp.int32), None)
    unwritten = np.arange(384)[None, None, :, None] > 300
    got = jax.jit(lambda q, k, v, m: da.one_query_pallas(q, k, v, m, 300, 0.3, interpret=True))(
        q, *(jnp.asarray(np.where(unwritten, np.nan, x)) for x in (k, v)), mask)
    k, v = (jnp.asarray(np.where(unwritten, 0.0, x)) for x in (k, v))
    close(got, one_query_attention(q, k, v, mask, 0.3))


def test_an_off_by_one_kernel_fails_the_comparison(monkeypatch):
    """The comparison above catches a kernel that stops one slot short (the query's own slot is
    the first of its block here: a last block one too early, its value zeroed)."""
    q, k, v, k_in, v_in, mask, index, kw = _case("query_first_in_its_block")
    want = _reference(q, k, v, mask, kw)
    close(_kernel(q, k, v, mask, index, kw, 1), want)
    right = da.block_bounds
    monkeypatch.setattr(da, "block_bounds", lambda index, *a, **k: right(index - 1, *a, **k))
    with pytest.raises(AssertionError):
        close(_kernel(q, k, v, mask, index, kw, 1), want)


def test_block_sizes_and_bounds():
    assert [da.block_k(n) for n in (384, 1024, 12, 96, 2000, 300, 2001)] == [128, 128, 12, 96, 400, 300, None]
    assert [da.block_k(n, keys_t=True) for n in (384, 96, 2000)] == [128, 96, None]  # positions on the lanes
    # qwen3-0.6b at batch 32: 8 kv heads x 128 x 128 bf16, keys and values: 512 KiB a row
    assert da.block_b(32, 8, 128, 128, 2) == 4 and da.block_b(3, 8, 128, 128, 2) == 3
    assert da.block_b(3, 8, 128, 128, 2, 1 << 20) == 1  # 2 rows fit 1 MiB but do not divide 3
    assert da.block_bounds(jnp.int32(300), 128).tolist() == [0, 2, 300]
    assert da.block_bounds(jnp.int32(300), 128, window=100).tolist() == [1, 2, 300]
    assert da.block_bounds(jnp.int32(300), 128, window=100, chunk=256).tolist() == [2, 2, 300]


# ------------------------------------------------------------------------------ in the model
TINY = dict(hidden_size=32, intermediate_size=64, vocab_size=128, max_position_embeddings=32)


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many layers traced the kernel (attention.py calls it by this name)."""
    calls = []
    real = attention_module.one_query_pallas
    monkeypatch.setattr(attention_module, "one_query_pallas", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("decode_layers", ["unroll", "scan"])
def test_generate_with_the_kernel_gives_the_xla_tokens(decode_layers, kernel_calls):
    """Greedy ``generate`` of a tiny llama, two rows left-padded: the same tokens. Its 6 layers: an
    unrolled first, two scanned periods of two (the kernel reading the stacks in place), an
    unrolled last."""
    _, config = get_model("llama-tiny", **TINY, decode_layers=decode_layers, num_hidden_layers=6,
                          scan_layout=(1, 2, 2))
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    config = config.replace(decode_cache_segments=2)  # the kernel over a cache grown between two stretches too
    programs = {d: Program(config.replace(decode_attention=d), get_rules("dp"), mesh) for d in ("xla", "pallas")}
    params = programs["xla"].init(np.asarray(jax.random.PRNGKey(3), np.uint32)).params
    prompt = np.asarray(jax.random.randint(jax.random.key(4), (4, 5), 1, config.vocab_size))
    tokens = {d: np.asarray(p.decoding.generate(params, prompt, [5, 3, 5, 2], max_new_tokens=7))
              for d, p in programs.items()}
    np.testing.assert_array_equal(tokens["pallas"], tokens["xla"])
    assert len(np.unique(tokens["xla"][:, 5:])) > 4
    # traced once a layer (scanned: a period) in each of the sampling loop's two stretches
    assert len(kernel_calls) == (4 if decode_layers == "scan" else 6) * 2


def _step_hlo(decode_attention):
    """The compiled one-token ``decode_step`` of a 3-layer scanned llama-tiny (a 256-slot cache: two
    blocks of 128), and its stacked key cache's shape."""
    _, config = get_model("llama-tiny", **{**TINY, "max_position_embeddings": 256}, num_hidden_layers=3,
                          decode_layers="scan", decode_attention=decode_attention, kv_cache_transposed_keys="off")
    program = Program(config, get_rules("dp"), make_mesh("data=1", devices=jax.devices()[:1]))
    params = program.init(np.asarray(jax.random.PRNGKey(1), np.uint32)).params
    cache = program.decoding.new_cache(2, 256)
    token = jnp.zeros((2, 1), jnp.int32)
    step = jax.jit(dec.decode_step, static_argnums=0, donate_argnums=2)
    text = step.lower(program.decoding.decoder, params, cache, token, token).compile().as_text()
    return text, cache["layers"]["attn"]["cached_key"].shape


def test_scanned_decoding_with_the_kernel_never_slices_a_layers_cache_out():
    """With the kernel the layer scan carries the stacked keys and values whole (each layer writes
    its position in place and the kernel reads its layer there): no array of one layer's cache
    shape anywhere in the step; the XLA path slices each layer's out (so this check can fail)."""
    for mode, sliced in (("pallas", False), ("xla", True)):
        text, shape = _step_hlo(mode)
        one_layer = "f32[" + ",".join(map(str, shape[1:])) + "]"
        assert (re.search(r"= " + re.escape(one_layer) + r"\{", text) is not None) == sliced, mode


@pytest.mark.parametrize("name,overrides", [
    ("gemma2-tiny", dict(sliding_window=4)),  # soft-capped logits, windows shorter than the cache, GQA
    ("gemma2-tiny", dict(sliding_window=4, decode_layers="scan")),  # a scanned period: sliding, full
    ("llama-tiny", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, kv_cache_packing="on",
                        kv_cache_transposed_keys="off", num_hidden_layers=2)),  # head_dim 32: four kv heads a row
])
def test_decode_steps_with_the_kernel_equal_xla_logits(name, overrides, kernel_calls):
    """``decode_step`` logits, the prefill then one token a step over a 12-slot cache, two rows
    (the second's first three tokens padding)."""
    _, config = get_model(name, **{**TINY, **overrides})
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    x = np.asarray(jax.random.randint(jax.random.key(4), (2, 12), 0, config.vocab_size))
    pad = np.array([[0], [3]])
    seg = jnp.asarray(np.arange(12)[None, :] >= pad, jnp.int32)
    pos = jnp.asarray(np.maximum(np.arange(12)[None, :] - pad, 0))
    step = jax.jit(dec.decode_step, static_argnums=0)
    logits = {}
    for d in ("xla", "pallas"):
        program = Program(config.replace(decode_attention=d), get_rules("dp"), mesh)
        params = program.init(np.asarray(jax.random.PRNGKey(1), np.uint32)).params
        module, weights = program.decoding.decoder, program.decoding.decoding_params(params)
        out, cache = step(module, weights, program.decoding.new_cache(2, 12), x[:, :5], pos[:, :5], seg[:, :5])
        outs = [out]
        for i in range(5, 12):
            out, cache = step(module, weights, cache, x[:, i:i + 1], pos[:, i:i + 1], seg[:, i:i + 1])
            outs.append(out)
        logits[d] = np.asarray(jnp.concatenate(outs, axis=1))
    close(logits["pallas"], logits["xla"], name)
    assert np.abs(logits["xla"]).max() > 0.1 and kernel_calls


def test_kernel_for_chooses_xla_where_the_kernel_cannot_serve():
    e = get_model("llama-tiny", decode_attention="pallas")[1].execution
    kw = dict(batch=1, unserved=False, placement=None, cache_length=384, keys_t=False)
    assert da.kernel_for(e, length=1, **kw) == "pallas"
    assert da.kernel_for(e, length=5, **kw) == "xla"  # a prefill
    assert da.kernel_for(e, length=1, **{**kw, "unserved": True}) == "xla"  # sinks, ALiBi, ...
    assert da.kernel_for(e, length=1, **{**kw, "cache_length": 2001}) == "xla"  # no block divides it
    assert da.kernel_for(get_model("llama-tiny")[1].execution, length=1, **kw) == "xla"  # auto, on a CPU
    with pytest.raises(ModelError, match=r"^model 'llama-tiny': Execution.decode_attention='triton' is not one of "
                                         r"auto, xla, pallas$"):
        get_model("llama-tiny", decode_attention="triton")


def test_auto_takes_the_kernel_on_a_tpu_for_scanned_layers_from_batch_8(monkeypatch):
    """Where v5e measured it faster: scanned layers at batch 32 (1.15x, 1.48x), not batch 1 (0.99x);
    unrolled layers and CPUs keep XLA."""
    kw = dict(length=1, unserved=False, placement=None, cache_length=384, keys_t=False)
    scan, unroll = (get_model("llama-tiny", decode_layers=d)[1].execution for d in ("scan", "unroll"))
    assert scan.decode_attention == "auto"
    assert [da.kernel_for(scan, batch=b, **kw) for b in (1, 8, 32)] == ["xla"] * 3  # a CPU
    monkeypatch.setattr(da.jax, "default_backend", lambda: "tpu")
    assert [da.kernel_for(scan, batch=b, **kw) for b in (1, 7, 8, 32)] == ["xla", "xla", "pallas", "pallas"]
    assert da.kernel_for(unroll, batch=32, **kw) == "xla"
    assert da.kernel_for(dataclasses.replace(scan, decode_attention="xla"), batch=32, **kw) == "xla"
    assert da.reads_stack(scan, 1, None, 32) and not da.reads_stack(scan, 1, None, 4)
    # measured up to 8 kv rows; a many-headed MHA cache (every head against every row) stays in XLA
    assert [da.kernel_for(scan, batch=32, kv_rows=r, **kw) for r in (4, 8, 9, 32)] == ["pallas"] * 2 + ["xla"] * 2
    assert not da.reads_stack(scan, 1, None, 32, 32)
    assert da.kernel_for(dataclasses.replace(scan, decode_attention="pallas"), batch=32, kv_rows=32, **kw) == "pallas"
    cache = {"layers": {"attn": {"cached_key": jnp.zeros((2, 4, 6, 16, 8)), "cached_value": jnp.zeros((2, 4, 6, 16, 8)),
                                 "cache_index": jnp.zeros((2,), jnp.int32)}},
             "layers_0": {"attn": {"cached_value": jnp.zeros((4, 3, 16, 8))}}, "mamba": {"ssm_state": jnp.zeros(3)}}
    assert da.cache_kv_rows(cache) == 6 and da.cache_kv_rows({"mamba": {"ssm_state": jnp.zeros(3)}}) is None


def test_decode_block_kib_sets_the_rows_per_grid_step():
    """qwen3-0.6b's batch-32 cache (8 kv rows, 128 positions, 128 wide, bf16: 512 KiB a row):
    1 MiB holds 2 rows, 2 MiB (the default) 4, 4 MiB 8; the field is checked."""
    assert da.block_b(32, 8, 128, 128, 2, 1024 * 1024) == 2 and da.block_b(32, 8, 128, 128, 2, 4096 * 1024) == 8
    assert da.block_b(32, 8, 128, 128, 2, 2048 * 1024) == 4 == da.block_b(32, 8, 128, 128, 2)
    assert get_model("llama-tiny")[1].execution.decode_block_kib == 2048 == da.BLOCK_BYTES // 1024
    with pytest.raises(ModelError, match=r"decode_block_kib=8 must be an integer from 16 to 16384"):
        get_model("llama-tiny", decode_block_kib=8)


@pytest.mark.parametrize("shape", [
    (32, 16, 8, 128, 1, 384, False, 0),  # qwen3-0.6b at batch 32: 3 blocks of 128
    (32, 16, 8, 128, 1, 384, False, 28),  # the same, its layer of a scanned stack
    (1, 32, 8, 64, 2, 384, False, 0),  # llama3.2-1b at batch 1, two kv heads a row
    (4, 8, 2, 64, 2, 300, True, 0),  # one whole block, the keys transposed
])
def test_kernel_lowers_for_a_tpu(shape):
    """Pallas' TPU lowering (to Mosaic, without libtpu: ``jax.export`` for the "tpu" platform) of
    the kernel in bfloat16; what the chip's compiler then says is tests/tpu's."""
    batch, heads, kv, dim, pack, length, keys_t, layers = shape
    rows, width, lead = kv // pack, pack * dim, (layers,) if layers else ()
    args = [jax.ShapeDtypeStruct(s, t) for s, t in (
        ((batch, 1, heads, dim), jnp.bfloat16),
        (lead + (batch, rows) + ((width, length) if keys_t else (length, width)), jnp.bfloat16),
        (lead + (batch, rows, length, width), jnp.bfloat16), ((batch, 1, 1, length), jnp.bool_), ((), jnp.int32))]

    def fn(q, k, v, mask, index):
        return da.one_query_pallas(q, k, v, mask, index, 0.125, keys_t=keys_t, window=100, logit_cap=30.0,
                                   layer=index % 7 if layers else None, interpret=False)

    assert "tpu_custom_call" in jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
