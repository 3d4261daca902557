"""Kimi delta attention's rule (models/kimi_delta.py): the chunked training form equals the
token-by-token recurrence (outputs, final state and gradients, 1e-5) for lengths that are and are
not multiples of the chunk, with packed segments and an initial state; both equal transformers'
``chunk_kimi_delta_attention`` and ``recurrent_kimi_delta_attention`` (1e-5); the per-channel decay
matters (a per-head decay gives other outputs). fp32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as hf

from shardzoo.models import kimi_delta as kd
from shardzoo.models import linear_attention as la

CHUNK, HEADS, D = 4, 3, 8


def raw_inputs(length, seed=0):
    """q, k (not yet normalised), v, g [batch, length, heads, head_dim] (log decays), beta."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(ks[i], (2, length, HEADS, D)) for i in range(3))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (2, length, HEADS, D)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (2, length, HEADS)))
    return q, k, v, g, beta


def rule_inputs(length, seed=0):
    q, k, v, g, beta = raw_inputs(length, seed)
    seg = np.ones((2, length), np.int32)
    seg[0, length // 3:] = 2  # row 0: two documents; row 1: left padding (segment 0), then one
    seg[1, :3] = 0
    return (la.l2norm(q) * D**-0.5, la.l2norm(k), v, g, beta), jnp.asarray(seg)


@pytest.mark.parametrize("length", [12, 13, 3])
def test_chunked_equals_the_recurrence_with_gradients(length):
    xs, seg = rule_inputs(length)
    state = jax.random.normal(jax.random.key(7), (2, HEADS, D, D))
    prev = jnp.array([1, 5])  # row 0's state belongs to its first segment, row 1's to none of its own
    out1, s1 = la.gated_delta_step(*xs, seg, state, prev)
    out2, s2 = kd.kimi_delta_chunked(*xs, CHUNK, seg, state, prev)
    np.testing.assert_allclose(out2, out1, atol=1e-5, rtol=0)
    np.testing.assert_allclose(s2, s1, atol=1e-5, rtol=0)
    assert np.abs(kd.kimi_delta_chunked(*xs, CHUNK)[0] - out2).max() > 1e-2  # the segments matter

    def loss(fn, *args):
        out, final = fn(*args)
        probe = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(out * probe) + jnp.sum(jnp.sin(final))

    step = jax.grad(lambda xs, s: loss(la.gated_delta_step, *xs, seg, s, prev), argnums=(0, 1))(xs, state)
    chunked = jax.grad(lambda xs, s: loss(lambda *a: kd.kimi_delta_chunked(*a[:5], CHUNK, *a[5:]),
                                          *xs, seg, s, prev), argnums=(0, 1))(xs, state)
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(step), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_rule_equals_transformers_chunked_and_recurrent():
    """20 tokens from a random initial state: transformers' chunks of 16 and its recurrence (q, k
    normalised in the kernel) against shardzoo's chunks of 4 and its step (1e-5)."""
    q, k, v, g, beta = raw_inputs(20, seed=3)
    state = jax.random.normal(jax.random.key(8), (2, HEADS, D, D))
    t = [torch.tensor(np.asarray(x)) for x in (q, k, v, g, beta, state)]
    ref_chunk, ref_state = hf.chunk_kimi_delta_attention(*t[:3], g=t[3], beta=t[4], chunk_size=16,
                                                         initial_state=t[5], output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
    ref_step, _ = hf.recurrent_kimi_delta_attention(*t[:3], g=t[3], beta=t[4], initial_state=t[5],
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    xs = (la.l2norm(q) * D**-0.5, la.l2norm(k), v, g, beta)
    out, final = kd.kimi_delta_chunked(*xs, CHUNK, None, state)
    step, _ = la.gated_delta_step(*xs, None, state)
    np.testing.assert_allclose(out, ref_chunk.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(final, ref_state.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(step, ref_step.numpy(), atol=1e-5, rtol=0)
    per_head = jnp.broadcast_to(g.mean(-1, keepdims=True), g.shape)  # one decay per head: Gated DeltaNet's
    assert np.abs(kd.kimi_delta_chunked(*xs[:3], per_head, beta, CHUNK, None, state)[0] - out).max() > 1e-2
