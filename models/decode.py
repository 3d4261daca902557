"""Autoregressive decoding with a KV cache: cache setup, a sampler over a callable, ``generate``.

The cache is the model's flax "cache" collection (as in flax's lm1b): every attention layer
keeps ``cached_key`` / ``cached_value`` [batch, cache_length, kv_heads, head_dim],
``cached_segment_ids`` [batch, cache_length] and ``cache_index``; with scanned layers each
leaf has a leading layers axis. The arrays carry logical axes (``ax.BATCH``,
``ax.CACHE_LENGTH``, ``ax.KV_HEADS``, ``ax.HEAD_DIM``) so they shard under the same rules as
the model when built inside ``sharding.partition.activate(mesh, rules)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from shardzoo.models.layers import constrain


def _value(x):
    return x.value if isinstance(x, nn.Partitioned) else x


def _is_box(x):
    return isinstance(x, nn.Partitioned)


def abstract_cache(module, params, batch_size: int, max_length: int):
    """The cache's shapes (boxed, with logical axes) for ``max_length`` positions, no allocation.

    Traced from a decoding call on ``params`` (arrays or ShapeDtypeStructs), which creates the
    cache the way decoding will use it; the params themselves come from the program's one init.
    """
    tokens = jax.ShapeDtypeStruct((batch_size, max_length), jnp.int32)

    def first_call(params, tokens):
        _, variables = module.apply({"params": params}, tokens, positions=tokens, decode=True,
                                    mutable=["cache"])
        return variables["cache"]

    return jax.eval_shape(first_call, params, tokens)


def cache_logical_specs(module, params, batch_size: int, max_length: int):
    """Logical PartitionSpecs of every cache leaf (e.g. for ``partition.logical_shardings``)."""
    return nn.get_partition_spec(abstract_cache(module, params, batch_size, max_length))


def init_cache(module, params, batch_size: int, max_length: int):
    """An empty cache (zeros, index 0); constrained by its logical axes under an active mesh."""
    boxed = abstract_cache(module, params, batch_size, max_length)
    specs = nn.get_partition_spec(boxed)
    shapes = jax.tree.map(_value, boxed, is_leaf=_is_box)

    def make():
        return jax.tree.map(
            lambda s, spec: constrain(jnp.zeros(s.shape, s.dtype), tuple(spec)), shapes, specs
        )

    return jax.jit(make)()


def decode_step(module, params, cache, tokens, positions, segment_ids=None):
    """Run ``tokens`` [batch, length] (a prompt or one new token) through the cache.

    Returns (logits [batch, length, vocab], updated cache).
    """
    logits, variables = module.apply(
        {"params": params, "cache": cache}, tokens, positions=positions, segment_ids=segment_ids,
        decode=True, mutable=["cache"],
    )
    return logits, variables["cache"]


# ------------------------------------------------------------------------------------ sampler
def sample_logits(logits, key, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """One token per row from logits [batch, vocab]; greedy (argmax) when temperature is 0."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    neg = jnp.finfo(jnp.float32).min
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        keep = before < top_p  # always keeps the most likely token
        threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, neg, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def sample_loop(
    tokens_to_logits: Callable,
    state,
    first_logits,
    max_new_tokens: int,
    key,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_ids: Sequence[int] = (),
    pad_id: int = 0,
):
    """Sample ``max_new_tokens`` tokens per row, stopping early once every row has ended.

    ``tokens_to_logits(tokens [batch], state) -> (logits [batch, vocab], state)`` feeds the
    last sampled token; ``first_logits`` [batch, vocab] predicts the first new token. A row ends
    at its first token in ``eos_ids`` (kept); later slots hold ``pad_id``.
    Returns (tokens int32 [batch, max_new_tokens], state).
    """
    batch = first_logits.shape[0]
    eos = jnp.asarray(tuple(eos_ids) or (-1,), jnp.int32)

    def cond(carry):
        i, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, out, logits, done, state = carry
        token = sample_logits(logits, jax.random.fold_in(key, i), temperature, top_k, top_p)
        token = jnp.where(done, pad_id, token)
        out = jax.lax.dynamic_update_slice(out, token[:, None], (0, i))
        done = done | jnp.isin(token, eos)
        logits, state = tokens_to_logits(token, state)
        return i + 1, out, logits, done, state

    out = jnp.full((batch, max_new_tokens), pad_id, jnp.int32)
    carry = (jnp.int32(0), out, first_logits, jnp.zeros((batch,), bool), state)
    _, out, _, _, state = jax.lax.while_loop(cond, body, carry)
    return out, state


# ----------------------------------------------------------------------------------- generate
@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7, 8, 9))
def _generate(module, params, prompt, prompt_lengths, max_new_tokens, temperature, top_k, top_p,
              eos_ids, pad_id, key):
    batch, prompt_len = prompt.shape
    start = prompt_len - prompt_lengths  # left padding of each row
    slots = jnp.arange(prompt_len)[None, :]
    segment_ids = (slots >= start[:, None]).astype(jnp.int32)  # 0 on padding
    positions = jnp.maximum(slots - start[:, None], 0)
    cache = init_cache(module, params, batch, prompt_len + max_new_tokens)
    logits, cache = decode_step(module, params, cache, prompt, positions, segment_ids)

    def tokens_to_logits(token, state):
        cache, position = state
        logits, cache = decode_step(
            module, params, cache, token[:, None], position[:, None], jnp.ones_like(token)[:, None]
        )
        return logits[:, -1], (cache, position + 1)

    new, _ = sample_loop(
        tokens_to_logits, (cache, prompt_lengths), logits[:, -1], max_new_tokens, key,
        temperature, top_k, top_p, eos_ids, pad_id,
    )
    return jnp.concatenate([prompt, new], axis=1)


def generate(
    module,
    params,
    prompt_tokens,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    prompt_lengths=None,
):
    """Continue ``prompt_tokens`` int32 [batch, prompt_len]; returns int32 [batch, prompt_len + new].

    Greedy when ``temperature`` is 0; otherwise sampled with optional ``top_k`` / ``top_p``.
    Rows stop at ``eos_token_id`` (an id or several); the slots after it hold ``pad_token_id``
    (default: the first eos id, else 0). Prompts of different lengths are left-padded, with
    ``prompt_lengths`` int32 [batch] giving each row's real length (default: all of it).
    Runs under the caller's mesh and rules, if any (``sharding.partition.activate``).
    """
    prompt = jnp.asarray(prompt_tokens, jnp.int32)
    if prompt.ndim != 2:
        raise ValueError(f"prompt_tokens must be [batch, prompt_len], got shape {prompt.shape}")
    if isinstance(eos_token_id, int):
        eos_token_id = (eos_token_id,)
    eos_ids = tuple(int(e) for e in eos_token_id or ())
    if pad_token_id is None:
        pad_token_id = eos_ids[0] if eos_ids else 0
    if prompt_lengths is None:
        prompt_lengths = jnp.full((prompt.shape[0],), prompt.shape[1], jnp.int32)
    return _generate(
        module, params, prompt, jnp.asarray(prompt_lengths, jnp.int32), int(max_new_tokens),
        float(temperature), int(top_k), float(top_p), eos_ids, int(pad_token_id),
        jax.random.key(seed),
    )
