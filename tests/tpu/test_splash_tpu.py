"""Splash attention compiled for the TPU (not interpreted) equals XLA attention.

Run on the chip: ``JAX_PLATFORMS=tpu python3 -m pytest -q tests/tpu``; skipped elsewhere.
bf16 q, k, v at length 2048, 32 query / 8 kv heads: the kernel's output and its q, k, v
gradients against float32 XLA attention of the same (bf16-rounded) inputs, within 2e-2 of the
reference's largest magnitude; XLA's own bf16 attention is held to the same bound as a yardstick.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from shardzoo.models import get_model  # noqa: E402
from shardzoo.models.attention_kernels import attention_kernel, attention_mask, xla_attention  # noqa: E402
from shardzoo.models.splash import splash_attention  # noqa: E402

B, L, H, KV = 2, 2048, 32, 8
TOL = 2e-2  # of the reference's largest magnitude


def packed(seed):
    """Rows of 2-4 documents: segment ids and positions restarting at each."""
    rng = np.random.default_rng(seed)
    seg = np.sort(rng.integers(1, 5, (B, L)), axis=1).astype(np.int32)
    starts = np.concatenate([np.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    idx = np.broadcast_to(np.arange(L), (B, L))
    return jnp.asarray(seg), jnp.asarray(idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1), jnp.int32)


def error(a, b) -> float:
    """max |a - b| over the reference b's largest magnitude."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max()) / float(np.abs(b).max())


CASES = {  # name: (head_dim, window, chunk, cap)
    "causal_segments_64": (64, None, None, None),
    "causal_segments_128": (128, None, None, None),
    "window_segments_128": (128, 512, None, None),
    "chunked_segments_64": (64, None, 512, None),
    "softcap_padded_80": (80, None, None, 5.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_splash_bf16_equals_xla_forward_and_gradients(case):
    dim, window, chunk, cap = CASES[case]
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, L, n, dim)), jnp.bfloat16) for n in (H, KV, KV))
    seg, positions = packed(1)
    scale = dim ** -0.5
    probe = jnp.asarray(rng.normal(size=(B, L, H, dim)), jnp.float32)

    def splash(q, k, v):
        out = splash_attention(q, k, v, seg, positions, scale=scale, sliding_window=window, chunk=chunk,
                               logit_cap=cap, interpret=False)
        return jnp.sum(out.astype(jnp.float32) * probe), out

    def xla(q, k, v):
        mask = attention_mask(positions, positions, seg, seg, window, chunk)
        out = xla_attention(q, k, v, mask, scale, cap)
        return jnp.sum(out.astype(jnp.float32) * probe), out

    grad = lambda f: jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))  # noqa: E731
    (_, want), want_grads = grad(xla)(*(x.astype(jnp.float32) for x in (q, k, v)))
    (_, got), grads = grad(splash)(q, k, v)
    (_, xla_got), xla_grads = grad(xla)(q, k, v)  # XLA's own bf16 error, shown beside splash's
    for what, a, b, c in zip(("out", "dq", "dk", "dv"), (got, *grads), (want, *want_grads), (xla_got, *xla_grads),
                             strict=True):
        assert error(a, b) <= TOL, f"{what}: splash {error(a, b):.3g}, xla bf16 {error(c, b):.3g} (bound {TOL})"


def test_auto_runs_splash_on_the_tpu_and_gives_xlas_logits():
    _, config = get_model("llama-tiny")
    assert attention_kernel(config, jnp.dtype("float32"), 256) == "splash"
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 128, (2, 256)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(256), (2, 256))
    xla, _ = get_model("llama-tiny", attention_impl="xla")
    auto, _ = get_model("llama-tiny")
    params = nn.unbox(xla.init(jax.random.key(0), tokens)["params"])
    want = jax.jit(lambda p: xla.apply({"params": p}, tokens, positions))(params)
    got = jax.jit(lambda p: auto.apply({"params": p}, tokens, positions))(params)
    assert error(got, want) <= TOL
    assert "tpu_custom_call" in jax.jit(lambda p: auto.apply({"params": p}, tokens, positions)).lower(
        params).compile().as_text()  # the Pallas kernel, not XLA's attention
