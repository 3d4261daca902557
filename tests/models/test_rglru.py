"""RecurrentGemma's recurrent block (models/rglru.py): the associative scan equals the token-by-token
recurrence, from a zero state and from a carried one (decoding a prompt, then token by token, is
tests/hf/test_hf_famG.py's greedy parity with transformers). Tolerance: 1e-5 in float32."""

import jax
import numpy as np

from shardzoo.models.rglru import rglru_scan, rglru_steps


def test_the_scan_is_the_recurrence():
    ka, ku, ks = jax.random.split(jax.random.PRNGKey(0), 3)
    a = jax.random.uniform(ka, (2, 13, 3, 4), minval=0.0, maxval=1.0)  # [batch, length, blocks, features]
    u = jax.random.normal(ku, (2, 13, 3, 4))
    state = jax.random.normal(ks, (2, 3, 4))
    for s in (None, state):
        got, last = jax.jit(rglru_scan)(a, u, s)
        want, want_last = jax.jit(rglru_steps)(a, u, s)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        np.testing.assert_allclose(last, want_last, atol=1e-5, rtol=0)

