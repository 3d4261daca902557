"""A hand-written Llama train step in plain JAX (no Flax, no logical axes): the bar for shardzoo.

The fastest plain form found on XLA:CPU: 2-D weights, k|v and gate|up each as one matmul,
``jax.nn.dot_product_attention``. With ``attention=False`` the attention is replaced by a copy of
the values (no scores, no softmax): not a model, a floor for what any JAX Llama step costs here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


def init(config, key):
    """Parameters: a dict of 2-D arrays (and norm scales), normal(0.02) like HF's init."""
    e, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = config.head_size
    nq, nkv = config.num_attention_heads * hd, config.kv_heads * hd
    keys = iter(jax.random.split(key, 5 * config.num_hidden_layers + 2))

    def normal(shape):
        return 0.02 * jax.random.normal(next(keys), shape, jnp.float32)

    layers = [dict(attn_norm=jnp.ones(e), mlp_norm=jnp.ones(e), q=normal((e, nq)),
                   kv=normal((e, 2 * nkv)), o=normal((nq, e)), gate_up=normal((e, 2 * f)),
                   down=normal((f, e))) for _ in range(config.num_hidden_layers)]
    return dict(embed=normal((v, e)), lm_head=normal((e, v)), norm=jnp.ones(e), layers=layers)


def _rms(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def _rope(x, inv_freq):
    length, half = x.shape[1], x.shape[-1] // 2
    freqs = np.arange(length, dtype=np.float32)[:, None] * inv_freq
    emb = np.concatenate([freqs, freqs], -1)[None, :, None, :]
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def forward(config, params, tokens, attention: bool = True):
    """Logits [batch, length, vocab] of a Llama (rotary, GQA, SwiGLU, RMSNorm, untied head)."""
    batch, length = tokens.shape
    hd, nh, nkv = config.head_size, config.num_attention_heads, config.kv_heads
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)
    x = params["embed"][tokens]
    for layer in params["layers"]:
        h = _rms(x, layer["attn_norm"], config.rms_norm_eps)
        q = _rope((h @ layer["q"]).reshape(batch, length, nh, hd), inv_freq)
        k, v = jnp.split((h @ layer["kv"]).reshape(batch, length, 2 * nkv, hd), 2, axis=2)
        if attention:
            ctx = jax.nn.dot_product_attention(q, _rope(k, inv_freq), v, is_causal=True)
        else:
            ctx = q + jnp.repeat(v, nh // nkv, axis=2)
        x = x + ctx.reshape(batch, length, nh * hd) @ layer["o"]
        gate, up = jnp.split(_rms(x, layer["mlp_norm"], config.rms_norm_eps) @ layer["gate_up"], 2, -1)
        x = x + (jax.nn.silu(gate) * up) @ layer["down"]
    return _rms(x, params["norm"], config.rms_norm_eps) @ params["lm_head"]


def train_step(config, learning_rate: float, attention: bool = True):
    """(step, init): a jitted AdamW step on next-token cross-entropy, as the shardzoo bench's."""
    tx = optax.adamw(learning_rate)

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = forward(config, p, tokens[:, :-1], attention)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def make_state(key):
        params = init(config, key)
        return params, tx.init(params)

    return jax.jit(step, donate_argnums=(0, 1)), make_state
