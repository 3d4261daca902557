"""RecurrentGemma's recurrent block (models/rglru.py): the associative scan equals the token-by-token
recurrence, from a zero state and from a carried one; packed texts run as alone (decoding a prompt, then token by token, is
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



def test_packed_segments_run_as_alone():
    """Two texts packed in one row (positions and segment ids restarting) give each text's logits alone."""
    import jax.numpy as jnp
    from flax import linen as nn

    from shardzoo.models.transformer import TransformerConfig

    config = TransformerConfig.from_fields(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        layer_types=["recurrent"], lru_width=24, norm_type="rmsnorm_plus_one", bos_token_id=None, eos_token_id=None)
    module = config.build()
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 12), 0, 64)
    params = nn.meta.unbox(jax.jit(module.init)(jax.random.PRNGKey(2), tokens)["params"])
    params = jax.tree_util.tree_map(lambda p: p + 0.3 * jax.random.normal(jax.random.PRNGKey(3), p.shape), params)
    positions = jnp.concatenate([jnp.arange(5), jnp.arange(7)])[None]
    segments = jnp.array([[1] * 5 + [2] * 7])
    apply = jax.jit(lambda t, p, s: module.apply({"params": params}, t, p, s))
    packed = apply(tokens, positions, segments)
    first = apply(tokens[:, :5], positions[:, :5], segments[:, :5])
    second = apply(tokens[:, 5:], positions[:, 5:], segments[:, 5:])
    np.testing.assert_allclose(packed, np.concatenate([first, second], axis=1), atol=1e-5, rtol=0)
