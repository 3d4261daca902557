"""RecurrentGemma's recurrent block (models/rglru.py): the associative scan equals the token-by-token
recurrence, from a zero state and from a carried one; and a model of recurrent layers decodes a
prompt in pieces as it scores it whole. Tolerance: 1e-5 in float32."""

import jax
import jax.numpy as jnp
import numpy as np

from shardzoo.models.rglru import rglru_scan, rglru_steps
from shardzoo.models.transformer import TransformerConfig


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


def test_decoding_in_pieces_scores_as_the_whole():
    """A prompt of 6 tokens then one token a step (the cached conv inputs and RG-LRU state carried)
    gives the logits of the 12 tokens scored at once."""
    from flax import linen as nn

    from shardzoo.models.decode import cache_init_fn, decode_step

    config = TransformerConfig.from_fields(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        layer_types=["recurrent", "recurrent"], lru_width=24, norm_type="rmsnorm_plus_one", bos_token_id=None,
        eos_token_id=None)
    module = config.build()
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, 64)
    params = nn.meta.unbox(module.init(jax.random.PRNGKey(2), tokens)["params"])
    params = jax.tree_util.tree_map(lambda p: p + 0.1 * jax.random.normal(jax.random.PRNGKey(3), p.shape), params)
    whole = jax.jit(module.apply)({"params": params}, tokens)
    cache = nn.meta.unbox(cache_init_fn(module, 2, 12)(params))
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    step = jax.jit(decode_step, static_argnums=0)
    logits, cache = step(module, params, cache, tokens[:, :6], positions[:, :6])
    got = [logits]
    for i in range(6, 12):
        logits, cache = step(module, params, cache, tokens[:, i:i + 1], positions[:, i:i + 1])
        got.append(logits)
    np.testing.assert_allclose(np.concatenate(got, axis=1), whole, atol=1e-5, rtol=0)
