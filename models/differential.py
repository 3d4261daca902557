"""Differential attention (DiffLlama, arXiv:2410.05258), an option of ``models/attention.py``
(``diff_attention``): each query head's softmax weights read a pair of value heads (the kv head's
group and its twin in the other half of the kv heads, ``paired_values``); the first half of the
query heads minus lambda times the second half, RMS-normalised per head pair without weight and
scaled by 1 - lambda_init (``differential``). lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 .
lambda_k2) + lambda_init, with lambda_init = 0.8 - 0.6 exp(-0.3 layer) (``lambda_init``), which
each layer's ``LayerSpec`` carries."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from shardzoo.models import ModelError
from shardzoo.models.layers import dtype_of
from shardzoo.sharding import axes as ax


def lambda_init(layer: int) -> float:
    """The layer's lambda_init (DiffLlama's lambda_init_fn)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


def paired_values(v):
    """[batch, length, kv_heads, head_dim] -> [batch, length, kv_heads, 2 head_dim]: kv head j's
    values beside those of head j + kv_heads / 2 (j taken modulo kv_heads / 2), as DiffLlama's two
    attention calls over the value heads' halves, each tiled twice, read them."""
    half = v.shape[2] // 2
    first, second = v[:, :, :half], v[:, :, half:]
    return jnp.concatenate([jnp.concatenate([first, second], -1)] * 2, axis=2)


def differential(module, ctx, init: float, eps: float, param_dtype, std: float):
    """DiffLlama's output of ``ctx`` [batch, length, heads, 2 head_dim] (the softmax weights times
    ``paired_values``): [batch, length, heads, head_dim], the lambdas' parameters (``lambda_q1``,
    ``lambda_k1``, ``lambda_q2``, ``lambda_k2``, each [head_dim]) created under ``module``."""
    batch, length, heads, width = ctx.shape
    names = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
    init_fn = nn.with_logical_partitioning(nn.initializers.normal(std), (ax.HEAD_DIM,))
    q1, k1, q2, k2 = (module.param(n, init_fn, (width // 2,), dtype_of(param_dtype)).astype(jnp.float32) for n in names)
    lam = (jnp.exp(jnp.sum(q1 * k1)) - jnp.exp(jnp.sum(q2 * k2)) + init).astype(ctx.dtype)
    out = (ctx[:, :, : heads // 2] - lam * ctx[:, :, heads // 2:]).astype(jnp.float32)  # [b, l, heads / 2, 2 hd]
    out = out * jax.lax.rsqrt(jnp.mean(jnp.square(out), axis=-1, keepdims=True) + eps)
    out = ((1 - init) * out).astype(ctx.dtype)
    return out.reshape(batch, length, heads, width // 2)


def check(a) -> None:
    """Its value heads come in two halves."""
    if a.kv_heads % 2:
        raise ModelError(f"diff_attention pairs the value heads of two halves: num_key_value_heads={a.kv_heads} "
                         "must be even")
    if a.latent:
        raise ModelError("diff_attention is an option of ordinary attention, not of latent attention (kv_lora_rank)")
