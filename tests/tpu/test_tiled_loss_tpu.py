"""The vocabulary-tiled loss on a TPU at llama3.2-1b's head: 4 x 2048 tokens, embed 2048, vocab
128256, bf16 hidden states and head, float32 loss. Skips off a TPU; run there with
``JAX_PLATFORMS=tpu python3 -m pytest -q tests/tpu/test_tiled_loss_tpu.py``.

Tolerances: both paths compute the bf16 logits with the same matmul, but XLA may tile a chunk's
contraction differently from the whole one's, so single logits can differ by a bf16 rounding
(about 0.4% of a logit); the float32 reductions differ in order only. Hence: the mean loss within
1e-3, each token's loss within 5e-2, and each gradient within 2% of its norm (relative Frobenius
error), against the untiled computation (full logits, optax's cross-entropy).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardzoo.models.tiled_loss import HeadInputs, head_logits, weighted_nll

ROWS, LENGTH, EMBED, VOCAB = 4, 2048, 2048, 128256


def _inputs():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    hidden = jax.random.normal(k[0], (ROWS, LENGTH, EMBED), jnp.bfloat16)  # normed: unit scale
    kernel = (jax.random.normal(k[1], (EMBED, VOCAB), jnp.float32) * 0.02).astype(jnp.bfloat16)
    targets = jax.random.randint(k[2], (ROWS, LENGTH), 0, VOCAB)
    weights = (jax.random.uniform(k[3], (ROWS, LENGTH)) > 0.1).astype(jnp.float32)
    return hidden, kernel, targets, weights


def _losses(tiled, hidden, kernel, targets, weights):
    """Per-token losses and their weighted sum; ``tiled``: None (untiled) or the tiled loss's
    backward ("recompute", "fused"), "-contiguous" for contiguous vocabulary chunks (the default
    on one device where they divide the vocabulary: 16 x 8,016 here)."""
    backward, _, layout = (tiled or "recompute").partition("-")
    head = HeadInputs(hidden, kernel, None, length_chunk=512, vocab_chunk=8192, backward=backward,
                      contiguous=layout == "contiguous")
    if tiled:
        total, stats = weighted_nll(head, targets, weights)
        return stats.lse - stats.target, total
    losses = optax.softmax_cross_entropy_with_integer_labels(head_logits(head).astype(jnp.float32), targets)
    return losses, jnp.sum(losses * weights)


def _mean(tiled, hidden, kernel, targets, weights):
    return _losses(tiled, hidden, kernel, targets, weights)[1] / jnp.sum(weights)


@functools.cache
def _compiled(tiled):
    fn = jax.jit(jax.value_and_grad(functools.partial(_mean, tiled), (0, 1)))
    return fn.lower(*_inputs()).compile()


@pytest.mark.parametrize("backward", ["recompute", "fused", "recompute-contiguous"])
def test_tiled_loss_and_grads_match_untiled_on_tpu(backward):
    args = _inputs()
    (got, got_g), (want, want_g) = (_compiled(t)(*args) for t in (backward, None))
    assert abs(float(got) - float(want)) < 1e-3, (float(got), float(want))
    for name, g, w in zip(("hidden", "kernel"), got_g, want_g, strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel < 2e-2, (name, rel)
    per_token = [np.asarray(jax.jit(functools.partial(_losses, t))(*args)[0]) for t in (backward, None)]
    assert float(np.max(np.abs(per_token[0] - per_token[1]))) < 5e-2


@pytest.mark.parametrize("backward", ["recompute", "fused"])
def test_tiled_loss_needs_a_fraction_of_the_memory_on_tpu(backward):
    temp = {t: _compiled(t).memory_analysis().temp_size_in_bytes for t in (backward, None)}
    logits_f32 = ROWS * LENGTH * VOCAB * 4  # 4.2 GB
    print(f"temp bytes: tiled ({backward}) {temp[backward] / 1e9:.2f} GB, untiled {temp[None] / 1e9:.2f} GB")
    assert temp[backward] < temp[None] - logits_f32, temp
