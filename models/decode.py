"""Autoregressive decoding with a KV cache: the pieces, pure; ``train.Program`` compiles them.

The cache is the model's flax "cache" collection (as in flax's lm1b): every attention layer
keeps ``cached_key`` / ``cached_value`` [batch, kv_heads, cache_length, head_dim] (the layout a
decoding step reads, ``attention_kernels.KV_CACHE_AXES``; on a CPU the keys [batch, kv_heads,
head_dim, cache_length], ``keys_transposed``),
``cached_segment_ids`` [batch, cache_length] and ``cache_index``; with scanned layers each
leaf has a leading layers axis. ``Program.generate`` runs scanned layers as
``execution.decode_layers`` says. "unroll" (the default): the same model with every layer
unrolled, the stacked params cut per layer (``unrolled_params``), each layer's cache its own
array. "scan": the layers scanned as training does (compile time flat in depth): the layer scan
reads the stacked cache only and returns what each layer wrote (``cache_writes``: an attention
layer's new positions, a recurrent layer's whole state), which ``write_cache`` puts into the
stack after the scan, so the sampling loop updates the cache in place (a scan's per-layer cache
outputs would be a new stacked cache every step). A conv layer (LFM2's short convolution,
models/conv_mixer.py) keeps its own state instead: ``conv_state`` [batch, conv_width,
conv_channels], its last conv_kernel - 1 inputs, and their ``conv_segment_ids``; a mamba layer (models/ssm.py) its convolutions' last
inputs (``conv_x_state``, ``conv_b_state``, ``conv_c_state`` and their segment ids) and its
recurrent ``ssm_state`` [batch, ssm_heads, ssm_head_dim, ssm_state] with ``ssm_segment_ids``; a
linear-attention layer (Qwen3-Next's Gated DeltaNet, models/linear_attention.py) its
``recurrent_state`` [batch, linear_heads, linear_key_dim, linear_value_dim] (float32), its
``state_segment_id`` and its convolution's last inputs (``conv_q``, ``conv_k``, ``conv_v``):
none of these grows with the length. The arrays carry logical axes (``ax.BATCH``,
``ax.CACHE_LENGTH``, ``ax.KV_HEADS``, ``ax.HEAD_DIM``, ``ax.CONV_WIDTH``, ``ax.CONV_CHANNELS``,
``ax.SSM_*``, ``ax.LINEAR_*``), so
the Program shards them under the same rules as everything else (``Program.generate``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from shardzoo.models.attention_kernels import KEY_CACHE_T_AXES, KV_CACHE_AXES
from shardzoo.models.layers import fuses
from shardzoo.models.tiled_loss import HeadInputs, head_logits
from shardzoo.sharding import axes as ax


def cache_init_fn(module, batch_size: int, max_length: int):
    """``params -> cache``: the decoding call that creates the cache for ``max_length``
    positions (zeros, index 0); traced abstractly it gives the cache's boxed shapes."""
    tokens = jnp.zeros((batch_size, max_length), jnp.int32)

    def first_call(params):
        _, variables = module.apply({"params": params}, tokens, positions=tokens, decode=True,
                                    mutable=["cache"])
        return jax.tree.map(jnp.zeros_like, variables["cache"])  # boxed: logical axes kept

    return first_call


def unrolled_params(layout, params):
    """``params`` of a model with scanned layers as the same model with every layer unrolled
    (``layers_i``) takes them: each stacked leaf cut into its layers. Decoding with
    ``decode_layers="unroll"`` runs the layers so: each layer's cache is then its own array,
    updated in place by the sampling loop (the cut is a copy of the stacked weights inside the
    program; params already unrolled are read where they are)."""
    out = {k: v for k, v in params.items() if k != "layers" and not k.startswith("layers_")}
    for path, layers, stacked in layout.param_layout():
        tree = params
        for name in path:
            tree = tree[name]
        for k, layer in enumerate(layers):
            out[f"layers_{layer}"] = jax.tree.map(lambda x, k=k: x[k], tree) if stacked else tree
    return out


# the logical axes a kernel onto heads ends with (q, k, v; Qwen3-Next's output gate)
HEAD_KERNEL_AXES = ((ax.EMBED, ax.HEADS, ax.HEAD_DIM), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM))


def flat_head_kernels(params, boxed, head_dims: Callable[[int], bool]):
    """``params`` with every Linear kernel onto heads (a ``kernel`` whose logical axes in
    ``boxed``, the same tree with its ``nn.Partitioned`` boxes, end in embed, heads or kv_heads,
    head_dim) of a head_dim ``head_dims`` takes, stored flat: ``[..., embed, heads x head_dim]``
    (the stacked layers' leading axis kept). ``layers.Linear`` reads a kernel so stored and shapes
    its output back, so the numbers are the same; decoding's layout: a TPU pads an array's minor
    dim to its 128 lanes, so a head_dim of 64 doubles those kernels' bytes in memory and every
    decoding step read the padding (``execution.decode_flat_heads``)."""
    def one(path, x, box):
        names = tuple(getattr(box, "names", ()) or ())
        if getattr(path[-1], "key", None) == "kernel" and names[-3:] in HEAD_KERNEL_AXES and head_dims(x.shape[-1]):
            return x.reshape(x.shape[:-2] + (x.shape[-2] * x.shape[-1],))
        return x

    return jax.tree_util.tree_map_with_path(one, params, boxed)


def cache_writes(old, new, length: int, keys_t: bool):
    """What one layer's decoding call of ``length`` tokens wrote into its cache ``old`` (``new``:
    the cache after it): of an attention cache (a subtree with ``cache_index``) the ``length``
    new positions of each [batch, cache_length, ...] array, at the old index, and the new index;
    every other state (convolutions', recurrences') whole. The layer scan emits these. ``keys_t``:
    the keys held transposed (``attention_kernels.keys_transposed``)."""
    if not isinstance(new, dict):
        return new
    if "cache_index" not in new:
        return {k: cache_writes(old[k], v, length, keys_t) for k, v in new.items()}
    i = old["cache_index"]
    return {k: v if k == "cache_index" else jax.lax.dynamic_slice_in_dim(v, i, length, axis=_length_axis(k, keys_t))
            for k, v in new.items()}


def write_cache(cache, writes, keys_t: bool):
    """The stacked cache (a leading layers axis) with the layer scan's ``writes``
    (``cache_writes``, stacked) in it: an attention cache's new positions written in place at the
    index (every layer's index is the same), the other states replaced."""
    if not isinstance(writes, dict):
        return writes
    if "cache_index" not in writes:
        return {k: write_cache(cache[k], v, keys_t) for k, v in writes.items()}
    i = cache["cache_index"][0]
    return {k: v if k == "cache_index" else
            jax.lax.dynamic_update_slice_in_dim(cache[k], v, i, axis=1 + _length_axis(k, keys_t))
            for k, v in writes.items()}


# decode_cache_segments "auto": a stretch of the sampling loop is a loop of its own to compile
# (a tiny llama's generate: 1.9 s in one loop, 3.5 s in four), so each must cover this many steps
STRETCH_STEPS = 32


def cache_segments(execution, max_new_tokens: int) -> int:
    """How many stretches the sampling loop runs in (``decode_cache_segments``; "auto": on a CPU,
    the one place this is chosen by backend, up to 4 of at least STRETCH_STEPS new tokens each,
    else 1). On a CPU a step's attention reads the whole cache single-threaded; over the positions
    filled by each stretch's end instead, batch 16's 128 new tokens after a 32-token prompt read
    112 positions on average, not 160 (``bench/bench_decode.py``)."""
    n = execution.decode_cache_segments
    if n != -1:
        return n
    return max(1, min(4, max_new_tokens // STRETCH_STEPS)) if jax.default_backend() == "cpu" else 1


def prefill_fuses(execution) -> bool:
    """Whether decoding's prefill runs ``fuse_projections``' one wide matmul per k|v and up|gate
    (``layers.fused`` stacks their kernels every call, a copy of them): as the execution says,
    except on a CPU (the one place this is chosen by backend), where a prefill's few hundred
    tokens do not repay the copy (batch 16 x 32 tokens, ``bench/bench_decode.py``'s model: 0.199
    -> 0.190 s a prefill and one step). A decoding step (one token per row) runs them apart anyway."""
    return fuses(execution) and jax.default_backend() != "cpu"


def segment_ends(max_new_tokens: int, segments: int) -> list[int]:
    """The new-token counts at which each stretch of the sampling loop ends: ``segments`` of
    near-equal length (fewer when there are fewer tokens), the last at ``max_new_tokens``. A
    stretch ending at ``n`` needs a cache of the prompt's length plus ``n`` positions."""
    return sorted({-(-max_new_tokens * k // segments) for k in range(1, segments + 1)} - {0}) or [max_new_tokens]


def grow_cache(cache, shapes):
    """``cache`` with each array padded at its end to the longer ``shapes`` (a tree of
    ``.shape``s: the cache of more positions, ``cache_init_fn``'s): the new positions zeros, as an
    empty cache holds them, and states that do not grow with the length as they are."""
    def pad(x, shape):
        return x if x.shape == shape.shape else jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, shape.shape, strict=True)])

    return jax.tree.map(pad, cache, shapes)


KV = ("cached_key", "cached_value")


def split_kv(cache):
    """(the keys and values of every attention cache in ``cache``, the rest), two trees (the
    first None where there are none). Where the decoding kernel reads the stack
    (``decode_attention.reads_stack``) the layer scan carries a stack's keys and values whole,
    each layer writing and reading its own in place (index ``cache_layer``: ``join_kv``), where
    slicing them out as the scan's inputs copied every layer's; its other arrays go through the
    scan as before."""
    if not isinstance(cache, dict):
        return None, cache
    if "cached_key" in cache:
        return {k: cache[k] for k in KV}, {k: v for k, v in cache.items() if k not in KV + ("cache_layer",)}
    pairs = {k: split_kv(v) for k, v in cache.items()}
    return {k: kv for k, (kv, _) in pairs.items() if kv} or None, {k: rest for k, (_, rest) in pairs.items()}


def join_kv(rest, kv, layer=None):
    """``split_kv``'s inverse; ``layer`` (not None): each attention cache's ``cache_layer`` too."""
    if not kv:
        return rest
    if "cached_key" in kv:
        return {**rest, **kv, **({} if layer is None else {"cache_layer": layer})}
    return {k: join_kv(v, kv.get(k), layer) for k, v in rest.items()}


def _length_axis(name: str, keys_t: bool) -> int:
    """The positions' axis of an attention cache's array: keys and values are
    [batch, kv_heads, cache_length, head_dim] (``KV_CACHE_AXES``; the keys ``KEY_CACHE_T_AXES``
    where ``keys_t``), the rest [batch, cache_length, ...]."""
    if name == "cached_key" and keys_t:
        return KEY_CACHE_T_AXES.index(ax.CACHE_LENGTH)
    return KV_CACHE_AXES.index(ax.CACHE_LENGTH) if name in ("cached_key", "cached_value") else 1


def decode_step(module, params, cache, tokens, positions, segment_ids=None, last: bool = False):
    """Run ``tokens`` [batch, length] (a prompt or one new token) through the cache.

    Returns (logits [batch, length, vocab], updated cache); ``last``: the last position's logits
    only, [batch, 1, vocab] (a prefill's: the head reads one position per row, not the prompt's).
    """
    out, variables = module.apply(
        {"params": params, "cache": cache}, tokens, positions=positions, segment_ids=segment_ids,
        decode=True, mutable=["cache"], head=not last,
    )
    if last:
        out = head_logits(out, out.hidden[:, -1:]) if isinstance(out, HeadInputs) else out[:, -1:]
    return out, variables["cache"]


# ------------------------------------------------------------------------------------ sampler
def _order_keys(x):
    """uint32 keys in the order of the float32 values ``x`` (their bits, the negatives' flipped)."""
    bits = jax.lax.bitcast_convert_type(x + 0.0, jnp.int32)  # + 0.0: -0 as +0
    flipped = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return jax.lax.bitcast_convert_type(flipped, jnp.uint32) ^ jnp.uint32(0x80000000)


def _largest_key(keys, enough):
    """Per row of ``keys`` [rows, n], the largest T with ``enough(keys >= T)`` (a mask -> bool
    [rows], true at T = 0, monotone): bit by bit from the top, 32 masked reductions. Top-k and
    top-p thresholds without sorting the vocabulary (XLA:CPU sorts the whole row for top_k)."""
    def step(b, t):
        candidate = t | (jnp.uint32(1) << (31 - b).astype(jnp.uint32))
        return jnp.where(enough(keys >= candidate)[..., None], candidate, t)

    return jax.lax.fori_loop(0, 32, step, jnp.zeros(keys.shape[:-1] + (1,), jnp.uint32))


def _argmax(logits):
    """``jnp.argmax`` over the last axis (the first largest; the first NaN where there is one) as
    a max and a min over the indices holding it: two plain reductions where argmax's is one of
    (value, index) pairs, which XLA:CPU ran 4x slower over a [16, 8192] step's logits."""
    top = logits.max(-1, keepdims=True)
    at = (logits == top) | jnp.isnan(logits)
    return jnp.min(jnp.where(at, jnp.arange(logits.shape[-1], dtype=jnp.int32), logits.shape[-1]), -1)


def sample_logits(logits, key, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """One token per row from logits [batch, vocab]; greedy (argmax) when temperature is 0.

    Top-k keeps the tokens at least as likely as the k-th; top-p then keeps each token whose
    more likely tokens (among those kept) hold less than ``top_p`` of the mass."""
    if temperature == 0.0:
        return _argmax(logits)
    logits = logits.astype(jnp.float32) / temperature
    neg = jnp.finfo(jnp.float32).min
    keys = _order_keys(logits) if top_k or top_p < 1.0 else None
    if top_k:
        kth = _largest_key(keys, lambda at_least: at_least.sum(-1) >= top_k)
        logits = jnp.where(keys >= kth, logits, neg)
    if top_p < 1.0:
        probs = jax.nn.softmax(logits, axis=-1)  # the masked ones: exactly 0
        threshold = _largest_key(keys, lambda at_least: jnp.sum(jnp.where(at_least, probs, 0.0), -1) >= top_p)
        logits = jnp.where(keys >= threshold, logits, neg)
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
    grow: Sequence[tuple[int, Callable]] = (),
):
    """Sample ``max_new_tokens`` tokens per row, stopping early once every row has ended.

    ``tokens_to_logits(tokens [batch], state) -> (logits [batch, vocab], state)`` feeds the
    last sampled token; ``first_logits`` [batch, vocab] predicts the first new token. A row ends
    at its first token in ``eos_ids`` (kept); later slots hold ``pad_id``. ``grow``: ``(step,
    fn)`` pairs, steps ascending: the loop stops before new token ``step`` and goes on with
    ``fn(state)`` (decoding: the cache given more positions), each stretch a loop of its own.
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
    for end, fn in (*grow, (max_new_tokens, None)):
        carry = jax.lax.while_loop(lambda c, end=end: cond(c) & (c[0] < end), body, carry)
        if fn is not None:
            carry = (*carry[:4], fn(carry[4]))
    return carry[1], carry[4]


# ----------------------------------------------------------------------------------- generate
def generate_tokens(module, params, cache, prompt, prompt_lengths, key, *, max_new_tokens: int,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    eos_ids: Sequence[int] = (), pad_id: int = 0, grow: Sequence[tuple[int, Callable]] = ()):
    """Prefill ``prompt`` int32 [batch, prompt_len] (left-padded: row r's last
    ``prompt_lengths[r]`` slots) into the empty ``cache``, then sample ``max_new_tokens``;
    returns int32 [batch, prompt_len + max_new_tokens]. Pure: the Program jits it with the
    params', cache's and batch's shardings. ``grow``: ``(step, fn)`` pairs (``sample_loop``'s):
    before new token ``step`` is fed, the cache becomes ``fn(cache)`` (``grow_cache``: a cache
    only as long as each stretch of steps needs, ``segment_ends``)."""
    batch, prompt_len = prompt.shape
    start = prompt_len - prompt_lengths  # left padding of each row
    slots = jnp.arange(prompt_len)[None, :]
    segment_ids = (slots >= start[:, None]).astype(jnp.int32)  # 0 on padding
    positions = jnp.maximum(slots - start[:, None], 0)
    logits, cache = decode_step(module, params, cache, prompt, positions, segment_ids, last=True)

    def tokens_to_logits(token, state):
        cache, position = state
        logits, cache = decode_step(
            module, params, cache, token[:, None], position[:, None], jnp.ones_like(token)[:, None]
        )
        return logits[:, -1], (cache, position + 1)

    new, _ = sample_loop(
        tokens_to_logits, (cache, prompt_lengths), logits[:, -1], max_new_tokens, key,
        temperature, top_k, top_p, eos_ids, pad_id,
        [(step, lambda state, fn=fn: (fn(state[0]), state[1])) for step, fn in grow],
    )
    return jnp.concatenate([prompt, new], axis=1)
