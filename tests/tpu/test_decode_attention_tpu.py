"""The Pallas decoding kernel (``execution.decode_attention="pallas"``, models/decode_attention.py)
compiled for the chip, against the XLA path in bfloat16; and ``generate``'s tokens with it. Skips
off a TPU.

    JAX_PLATFORMS=tpu python3 -m pytest -q -p no:cacheprovider tests/tpu/test_decode_attention_tpu.py

Tolerance (bf16): both paths against a float64 reference computed on the host from the same
bfloat16 inputs; the kernel's largest error at most twice XLA's plus 2e-3 (its probabilities are
rounded to bfloat16 before normalising, XLA's after).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardzoo.models import decode as dec
from shardzoo.models import get_model
from shardzoo.models.attention_kernels import attention_mask, one_query_attention
from shardzoo.models.decode_attention import one_query_pallas
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.program import Program

SHAPES = {  # name: (batch, heads, kv_heads, head_dim, pack, cache length)
    "qwen3-0.6b_b32": (32, 16, 8, 128, 1, 384),
    "llama3.2-1b_b32_packed": (32, 32, 8, 64, 2, 384),
    "llama3.2-1b_b1_packed": (1, 32, 8, 64, 2, 384),
}


def _reference(q, k, v, mask, scale):
    """float64 on the host: q [batch, 1, heads, dim]; k, v [batch, rows, length, pack * dim]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, _, heads, dim = q.shape
    rows, pack = k.shape[1], k.shape[-1] // dim
    k, v = (x.reshape(batch, rows, -1, pack, dim).transpose(0, 1, 3, 2, 4).reshape(batch, rows * pack, -1, dim)
            for x in (k, v))  # [batch, kv_heads, length, dim]
    q = q[:, 0].reshape(batch, rows * pack, heads // (rows * pack), dim)
    s = np.einsum("bkgd,bkmd->bkgm", q, k) * scale
    s = np.where(np.asarray(mask), s, -np.inf)  # mask [batch, 1, 1, length]
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bkgm,bkmd->bkgd", p / p.sum(-1, keepdims=True), v).reshape(batch, 1, heads, dim)


@pytest.mark.parametrize("index", [127, 128, 300])
@pytest.mark.parametrize("name", list(SHAPES))
def test_kernel_equals_xla_in_bfloat16(name, index):
    batch, heads, kv, dim, pack, length = SHAPES[name]
    rng = np.random.default_rng(index)
    q = jnp.asarray(rng.normal(size=(batch, 1, heads, dim)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(batch, kv // pack, length, pack * dim)), jnp.bfloat16) for _ in range(2))
    pads = rng.integers(0, 100, batch) * (np.arange(batch) % 2)  # every other row left-padded
    seg = jnp.asarray(np.arange(length)[None, :] >= pads[:, None], jnp.int32)
    mask = attention_mask(jnp.full((batch, 1), index), jnp.broadcast_to(jnp.arange(length), (batch, length)),
                          jnp.ones((batch, 1), jnp.int32), seg, None)
    scale = dim ** -0.5
    garbage = jnp.arange(length)[None, None, :, None] > index  # unwritten: NaN for the kernel
    got = jax.jit(lambda q, k, v, m: one_query_pallas(q, k, v, m, index, scale, interpret=False))(
        q, jnp.where(garbage, jnp.nan, k), jnp.where(garbage, jnp.nan, v), mask)
    xla = jax.jit(lambda q, k, v, m: one_query_attention(q, k, v, m, scale))(q, k, v, mask)
    want = _reference(q, k, v, mask, scale)
    err, xla_err = (float(np.abs(np.asarray(x, np.float64) - want).max()) for x in (got, xla))
    print(f"{name} index {index}: kernel {err:.2e}, xla {xla_err:.2e}")
    assert err <= 2 * xla_err + 2e-3, (err, xla_err)


@pytest.mark.parametrize("decode_layers", ["unroll", "scan"])
def test_generate_with_the_kernel_gives_the_xla_tokens(decode_layers):
    """64 rows (every other left-padded), a 64-token prompt and 192 new tokens: a cache of two
    128-slot blocks, float32 weights, float32 matmuls on both paths ("highest": by default the
    chip's float32 matmuls round their inputs to bfloat16, XLA's and the kernel's in different
    places, and a random model's near-uniform logits then flipped 18% of the tokens on 2026-12-07).
    The kernel moves the rounding, not the arithmetic: a near-tie could still flip a token (and its
    row's rest), so at least 97% of the new tokens must agree."""
    _, config = get_model("llama-tiny", hidden_size=512, intermediate_size=1024, vocab_size=1024,
                          num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4,
                          max_position_embeddings=256, decode_layers=decode_layers)
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    programs = {d: Program(config.replace(decode_attention=d), get_rules("dp"), mesh) for d in ("xla", "pallas")}
    params = programs["xla"].init(np.asarray(jax.random.PRNGKey(0), np.uint32)).params
    prompt = np.random.default_rng(0).integers(1, config.vocab_size, (64, 64)).astype(np.int32)
    lengths = np.where(np.arange(64) % 2, 40, 64).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        tokens = {d: np.asarray(p.decoding.generate(params, prompt, lengths, max_new_tokens=192))
                  for d, p in programs.items()}
    same = (tokens["pallas"][:, 64:] == tokens["xla"][:, 64:]).mean()
    print(f"{decode_layers}: {same:.4f} of the new tokens agree")
    assert same >= 0.97, same
    assert len(np.unique(tokens["xla"][:, 64:])) > 8  # a real continuation, not one repeated token


def test_the_scanned_step_reads_and_writes_the_stack_in_place():
    """The chip's compiled one-token step, scanned layers, bf16: with the kernel no array of one
    layer's cache shape (none sliced out of the stack) and no copy of a stacked one, and the
    default ("auto") the same; the XLA path's program is printed beside it for the record."""
    _, config = get_model("llama-tiny", hidden_size=512, intermediate_size=1024, vocab_size=1024,
                          num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4,
                          max_position_embeddings=256, decode_layers="scan", dtype="bfloat16",
                          param_dtype="bfloat16")
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    counts = {}
    for mode in ("xla", "pallas", "auto"):
        program = Program(config.replace(decode_attention=mode), get_rules("dp"), mesh)
        params = program.init(np.asarray(jax.random.PRNGKey(1), np.uint32)).params
        cache = program.decoding.new_cache(32, 256)
        shape = cache["layers"]["attn"]["cached_key"].shape
        token = jnp.zeros((32, 1), jnp.int32)
        step = jax.jit(dec.decode_step, static_argnums=0, donate_argnums=2)
        text = step.lower(program.decoding.decoder, params, cache, token, token).compile().as_text()
        one, whole = ("bf16[" + ",".join(map(str, s)) + "]" for s in (shape[1:], shape))
        sliced = len(re.findall(r"= " + re.escape(one) + r"\{", text))
        copies = len(re.findall(r"= " + re.escape(whole) + r"\{[^}]*\} copy(?:-start)?\(", text))
        print(f"{mode}: stacked keys {shape}, one-layer arrays {sliced}, copies of a stack {copies}")
        counts[mode] = (sliced, copies)
    assert counts["pallas"] == (0, 0), counts
    assert counts["auto"] == counts["pallas"], counts  # the default takes the kernel: scanned, batch 32, a TPU
