"""A vocabulary-tiled head and cross-entropy: per-token statistics of the logits without forming them.

The decoder's head (``Transformer``) maps the normed hidden states ``[rows, length, embed]``
through ``kernel [embed, vocab]`` (the lm_head, or the tied embedding transposed), an optional
bias and the family's logit transforms (Granite's ``logits_scaling``, Cohere's ``logit_scale``,
Gemma's ``final_logit_softcapping``). A language-model loss only needs, per token, the
logsumexp of its logits and its target's logit (log p(target) = target logit - logsumexp); the
float32 logits of 4 x 2048 tokens over a 128k vocabulary take 4.2 GB.

``token_stats`` computes them in chunks: a scan over chunks of ``length`` positions (all rows
at once, so a batch sharded over devices stays sharded) and, inside, over chunks of the
vocabulary with an online logsumexp. Chunks are strided (chunk ``i`` of ``n`` holds entries
``i, i + n, ...``), so a length or vocabulary sharded in blocks over devices stays sharded in
every chunk: under tensor parallelism each device computes its own columns' logits only. Its backward (``jax.custom_vjp``) recomputes each chunk's
logits and accumulates the gradients of the hidden states, kernel and bias, so no [tokens, vocab]
array exists at any time. Its XLA reference path is the untiled computation on full logits
(``head_logits``), which is also what the model returns when asked for logits.

``weighted_nll`` is the language-model loss ``sum(weights * (lse - target))`` on these
statistics. With ``backward="fused"`` (``execution.tiled_loss_backward``) its forward computes the
gradients too, as Liger's fused linear cross-entropy does: the loss's coefficient of every
token's logits is known in the forward (``weights * (softmax - onehot)``), so each chunk of
positions takes its logits over the whole vocabulary once, and its hidden-state and kernel
gradients come from them at once; the backward only scales them by the loss's cotangent. Three
head matmuls a step instead of the recomputing backward's four, at the cost of a chunk of
positions' logits over the whole vocabulary (at most FUSED_BYTES) and the kernel's gradient
held from the forward on.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from shardzoo.models.layers import project
from shardzoo.sharding import axes as ax

# execution.tiled_loss == "auto" tiles where the float32 logits of a call would take more
# than this: one row of 2048 tokens over a 32k vocabulary; below it the untiled head is cheap.
AUTO_BYTES = 256 * 2**20
# the fused backward's float32 logits of one chunk of positions over the whole vocabulary
FUSED_BYTES = 128 * 2**20
BACKWARDS = ("recompute", "fused")


@struct.dataclass
class HeadInputs:
    """What the head would be applied to, in place of the logits: the normed hidden states
    ``[rows, length, embed]``, the head's ``kernel [embed, vocab]`` and ``bias [vocab]`` (or
    None) in the compute dtype, and its static transforms and chunk sizes."""

    hidden: jax.Array
    kernel: jax.Array
    bias: jax.Array | None
    logits_scaling: float = struct.field(pytree_node=False, default=1.0)  # Granite: logits / this
    logit_scale: float = struct.field(pytree_node=False, default=1.0)  # Cohere: logits * this
    softcap: float = struct.field(pytree_node=False, default=0.0)  # cap * tanh(logits / cap); 0: off
    length_chunk: int = struct.field(pytree_node=False, default=512)
    vocab_chunk: int = struct.field(pytree_node=False, default=8192)
    vocab: int = struct.field(pytree_node=False, default=0)  # the real columns (0: all); the rest padding
    backward: str = struct.field(pytree_node=False, default="recompute")  # weighted_nll's: BACKWARDS
    contiguous: bool = struct.field(pytree_node=False, default=False)  # vocabulary chunks (execution.loss_vocab_chunks)


class TokenStats(NamedTuple):
    """Per-token float32 statistics of the logits, each ``[rows, length]``. Gradients flow
    through ``lse`` and ``target`` only; ``max`` and ``entropy`` are metrics."""

    lse: jax.Array  # logsumexp over the vocabulary
    target: jax.Array  # the target's logit
    max: jax.Array  # the largest logit (the target is the greedy guess iff target >= max)
    entropy: jax.Array  # of the softmax

    @property
    def logp(self):
        """log p(target)."""
        return self.target - self.lse


def tiles(execution, tokens: int, vocab: int) -> bool:
    """Whether ``execution.tiled_loss`` ("auto", "on", "off") tiles a call over ``tokens``."""
    if execution.tiled_loss == "auto":
        return tokens * vocab * 4 > AUTO_BYTES
    return execution.tiled_loss == "on"


def _chunk_count(size: int, chunk: int) -> int:
    """How many chunks of at most ``chunk`` cover ``size``."""
    return -(-size // min(chunk, size))


def contiguous_chunks(execution, vocab: int, placement=None) -> bool:
    """Whether the ``vocab`` columns' chunks are contiguous (``execution.loss_vocab_chunks``):
    "auto" where they read the kernel in place, i.e. the chunks divide the vocabulary and no mesh
    axis of size > 1 holds it (one device, data or FSDP tables); strided elsewhere, where a
    contiguous kernel would be padded (a copy, as strided's) or a chunk would sit on few devices."""
    if execution.loss_vocab_chunks != "auto":
        return execution.loss_vocab_chunks == "contiguous"
    n_v = _chunk_count(vocab, execution.loss_vocab_chunk)
    return vocab % n_v == 0 and (placement is None or not any(  # the table's vocabulary, the head's
        placement.mesh_axes(ax.VOCAB, within) for within in ((ax.VOCAB, ax.EMBED), (ax.EMBED, ax.VOCAB))))


def _logits(h, kernel, bias, scaling, scale, softcap):
    """The head on ``h [..., embed]``, in the kernel's dtype: the model's own arithmetic."""
    logits = project(h.astype(kernel.dtype), kernel)
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    if scaling != 1.0:  # Granite
        logits = logits / jnp.asarray(scaling, logits.dtype)
    if scale != 1.0:  # Cohere
        logits = logits * jnp.asarray(scale, logits.dtype)
    if softcap:
        cap = jnp.asarray(softcap, logits.dtype)
        logits = cap * jnp.tanh(logits / cap)
    return logits


def head_logits(head: HeadInputs, hidden=None):
    """The logits ``[..., vocab]`` of ``hidden`` (default: ``head.hidden``): the untiled head."""
    hidden = head.hidden if hidden is None else hidden
    logits = _logits(hidden, head.kernel, head.bias, head.logits_scaling, head.logit_scale, head.softcap)
    if head.vocab and head.vocab < logits.shape[-1]:  # a padded vocabulary: never sampled, nothing in a softmax
        logits = jnp.where(jnp.arange(logits.shape[-1]) < head.vocab, logits, jnp.finfo(logits.dtype).min)
    return logits


def reference_stats(logits, targets) -> TokenStats:
    """``TokenStats`` from full logits ``[rows, length, vocab]``: the XLA reference path."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    p = jax.lax.stop_gradient(jnp.exp(logits - lse[..., None]))
    entropy = jax.lax.stop_gradient(lse) - jnp.sum(p * jax.lax.stop_gradient(logits), axis=-1)
    return TokenStats(lse, target, jax.lax.stop_gradient(jnp.max(logits, axis=-1)), entropy)


def token_stats(outputs, targets) -> TokenStats:
    """``TokenStats`` of a model's outputs on ``targets [rows, length]``: tiled when the model
    returned ``HeadInputs``, else from its logits."""
    if not isinstance(outputs, HeadInputs):
        return reference_stats(outputs, targets)
    h = outputs
    static = (h.logits_scaling, h.logit_scale, h.softcap, h.length_chunk, h.vocab_chunk, h.vocab, h.contiguous)
    lse, target, mx, entropy = _tiled(static, h.hidden, h.kernel, h.bias, targets)
    return TokenStats(lse, target, jax.lax.stop_gradient(mx), jax.lax.stop_gradient(entropy))


def weighted_nll(outputs, targets, weights):
    """``(sum(weights * -log p(target)), TokenStats)`` of a model's outputs on ``targets [rows,
    length]`` with float32 ``weights [rows, length]``: tiled when the model returned
    ``HeadInputs`` (its ``backward``: "recompute" the logits in the backward, or "fused" into the
    forward; the stats are then metrics only), else from its logits."""
    if not (isinstance(outputs, HeadInputs) and outputs.backward == "fused"):
        stats = token_stats(outputs, targets)
        return jnp.sum((stats.lse - stats.target) * weights), stats
    h = outputs
    static = (h.logits_scaling, h.logit_scale, h.softcap, h.length_chunk, h.vocab_chunk, h.vocab, h.contiguous)
    loss, stats = _fused(static, h.hidden, h.kernel, h.bias, targets, weights)
    return loss, TokenStats(*(jax.lax.stop_gradient(x) for x in stats))


# ------------------------------------------------------------------------------------- tiled
def _pad(x, axis: int, size: int):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _strided(x, axis: int, n: int):
    """``x`` with ``axis`` split into ``n`` strided chunks, the chunk axis first: chunk ``i``
    holds entries ``i, i + n, i + 2n, ...`` (``axis`` zero-padded to a multiple of ``n``), so
    where ``axis`` is sharded in contiguous blocks each chunk stays sharded the same way."""
    size = -(-x.shape[axis] // n)
    x = _pad(x, axis, size * n)
    x = x.reshape(x.shape[:axis] + (size, n) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis + 1, 0)


def _unstrided(x, axis: int, length: int):
    """The inverse of ``_strided`` (the chunk axis first), cut back to ``length`` entries."""
    x = jnp.moveaxis(x, 0, axis + 1)
    x = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
    return jax.lax.slice_in_dim(x, 0, length, axis=axis)


def _layout(static, hidden, kernel, bias, targets):
    """Chunked views: hidden ``[n_l, rows, lc, embed]`` and targets ``[n_l, rows, lc]`` (strided
    positions), kernel ``[n_v, embed, vc]`` and bias ``[n_v, vc]`` (strided vocabulary columns:
    a vocabulary sharded over devices stays sharded within each chunk; no device computes
    another's columns), or with ``static[6]`` (contiguous) the kernel's rows ``[n_v, vc, embed]``
    (``kernel.T``, a tied embedding as it is, cut in place) and the bias ``[n_v, vc]`` in order;
    and each chunk's column ids, ``cols(v)``."""
    n_l = _chunk_count(hidden.shape[1], static[3])
    vocab = kernel.shape[1]
    n_v = _chunk_count(vocab, static[4])
    hs, ts = _strided(hidden, 1, n_l), _strided(targets, 1, n_l)
    vc = -(-vocab // n_v)
    if static[6]:
        ks = _pad(kernel.T, 0, n_v * vc).reshape(n_v, vc, kernel.shape[0])
        bs = None if bias is None else _pad(bias, 0, n_v * vc).reshape(n_v, vc)
        return hs, ts, ks, bs, n_v, lambda v: jnp.arange(vc) + v * vc
    ks = _strided(kernel, 1, n_v)
    bs = None if bias is None else _strided(bias, 0, n_v)
    return hs, ts, ks, bs, n_v, lambda v: jnp.arange(vc) * n_v + v


def _as_kernel(static, k):
    """A chunk of ``_layout``'s kernel as ``[embed, vc]``."""
    return k.T if static[6] else k


def _unchunked_kernel(static, dks, shape):
    """The kernel's gradient ``shape`` ([embed, vocab]) from its chunks' (in ``_layout``'s form)."""
    if static[6]:
        return dks.reshape(-1, shape[0])[:shape[1]].T
    return _unstrided(dks, 1, shape[1])


def _unchunked_bias(static, dbs, vocab):
    """The bias's gradient ``[vocab]`` from its chunks'."""
    if static[6]:
        return dbs.reshape(-1)[:vocab]
    return _unstrided(dbs, 0, vocab)


def _chunk_logits(static, h, k, b, cols, vocab):
    """float32 logits ``[rows, lc, vc]`` of a chunk; columns past the vocabulary at -inf."""
    z = _logits(h, k, b, *static[:3]).astype(jnp.float32)
    return jnp.where(cols < vocab, z, -jnp.inf)


def _forward(static, hidden, kernel, bias, targets):
    vocab, length = static[5] or kernel.shape[1], hidden.shape[1]  # padded columns masked
    hs, ts, ks, bs, n_v, columns = _layout(static, hidden, kernel, bias, targets)

    def over_length(_, xs):
        h, t = xs  # [rows, lc, embed], [rows, lc]

        def over_vocab(carry, xs):
            m, s, u, tgt = carry
            k, b, v = xs
            cols = columns(v)
            z = _chunk_logits(static, h, _as_kernel(static, k), b, cols, vocab)  # [rows, lc, vc]
            m_new = jnp.maximum(m, jnp.max(z, axis=-1))
            e = jnp.exp(z - m_new[..., None])
            decay = jnp.exp(m - m_new)
            s = s * decay + jnp.sum(e, axis=-1)
            u = u * decay + jnp.sum(e * jnp.where(cols < vocab, z, 0.0), axis=-1)
            tgt = tgt + jnp.sum(jnp.where(cols == t[..., None], z, 0.0), axis=-1)
            return (m_new, s, u, tgt), None

        zeros = jnp.zeros(t.shape, jnp.float32)
        init = (jnp.full(t.shape, -jnp.inf, jnp.float32), zeros, zeros, zeros)
        (m, s, u, tgt), _ = jax.lax.scan(over_vocab, init, (ks, bs, jnp.arange(n_v)))
        lse = m + jnp.log(s)
        return None, (lse, tgt, m, lse - u / s)

    _, outs = jax.lax.scan(over_length, None, (hs, ts))  # each [n_l, rows, lc]
    return tuple(_unstrided(o, 1, length) for o in outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiled(static, hidden, kernel, bias, targets):
    return _forward(static, hidden, kernel, bias, targets)


def _tiled_fwd(static, hidden, kernel, bias, targets):
    outs = _forward(static, hidden, kernel, bias, targets)
    return outs, (hidden, kernel, bias, targets, outs[0])


def _tiled_bwd(static, res, cotangents):
    """d logit = g_lse * softmax + g_target * onehot, chunk by chunk (the max and entropy are
    metrics: their cotangents are dropped); the vocabulary is the outer loop so each kernel
    chunk's gradient sums over the tokens in a small carry."""
    hidden, kernel, bias, targets, lse = res
    g_lse, g_tgt = (g.astype(jnp.float32) for g in cotangents[:2])
    length, vocab = hidden.shape[1], static[5] or kernel.shape[1]  # padded columns masked
    hs, ts, ks, bs, n_v, columns = _layout(static, hidden, kernel, bias, targets)
    n_l = hs.shape[0]
    lses, g_lses, g_tgts = (_strided(x, 1, n_l) for x in (lse, g_lse, g_tgt))
    fn = lambda h, k, b: _logits(h, _as_kernel(static, k), b, *static[:3]).astype(jnp.float32)

    def over_vocab(dh, xs):
        k, b, v = xs
        cols = columns(v)

        def over_length(carry, xs):
            dk, db = carry
            h, t, lse_c, gl, gt = xs
            z, vjp = jax.vjp(fn, h, k, b)
            p = jnp.exp(jnp.where(cols < vocab, z, -jnp.inf) - lse_c[..., None])
            dz = gl[..., None] * p + jnp.where(cols == t[..., None], gt[..., None], 0.0)
            dh_c, dk_c, db_c = vjp(dz)
            dk = dk + dk_c.astype(jnp.float32)
            db = None if db is None else db + db_c.astype(jnp.float32)
            return (dk, db), dh_c.astype(jnp.float32)

        init = (jnp.zeros(k.shape, jnp.float32), None if b is None else jnp.zeros(b.shape, jnp.float32))
        (dk, db), dh_v = jax.lax.scan(over_length, init, (hs, ts, lses, g_lses, g_tgts))
        return dh + dh_v, (dk.astype(kernel.dtype), None if db is None else db.astype(bias.dtype))

    dh0 = jnp.zeros(hs.shape, jnp.float32)
    dh, (dks, dbs) = jax.lax.scan(over_vocab, dh0, (ks, bs, jnp.arange(n_v)))
    dh = _unstrided(dh, 1, length).astype(hidden.dtype)
    dk = _unchunked_kernel(static, dks, kernel.shape)
    db = None if dbs is None else _unchunked_bias(static, dbs, kernel.shape[1])
    return dh, dk, db, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


# ------------------------------------------------------------------------------------- fused
def _fused_forward(static, hidden, kernel, bias, targets, weights):
    """The loss, its statistics and its gradients by (hidden, kernel, bias): a scan over strided
    chunks of positions (all rows; at most ``length_chunk`` and FUSED_BYTES of float32 logits),
    each chunk's logits over the whole vocabulary formed once."""
    rows, length = targets.shape
    padded = kernel.shape[1]
    vocab = static[5] or padded
    chunk = max(1, min(static[3], length, FUSED_BYTES // (4 * rows * padded)))
    n_l = -(-length // chunk)
    hs, ts, ws = (_strided(x, 1, n_l) for x in (hidden, targets, weights.astype(jnp.float32)))
    cols = jnp.arange(padded)
    fn = lambda h, k, b: _logits(h, k, b, *static[:3]).astype(jnp.float32)

    def over_length(carry, xs):
        dk, db = carry
        h, t, w = xs  # [rows, lc, embed], [rows, lc], [rows, lc]
        z, vjp = jax.vjp(fn, h, kernel, bias)
        z = jnp.where(cols < vocab, z, jnp.finfo(jnp.float32).min)  # padding as head_logits leaves it
        stats = reference_stats(z, t)
        p = jnp.exp(z - stats.lse[..., None])  # the padding's: 0
        hit = cols == t[..., None]
        dh_c, dk_c, db_c = vjp(w[..., None] * (p - hit))  # d loss / d logits = w (softmax - onehot)
        dk = dk + dk_c.astype(jnp.float32)
        db = None if db is None else db + db_c.astype(jnp.float32)
        return (dk, db), (jnp.sum(w * (stats.lse - stats.target)), tuple(stats), dh_c)

    init = (jnp.zeros(kernel.shape, jnp.float32), None if bias is None else jnp.zeros(bias.shape, jnp.float32))
    (dk, db), (losses, stats, dh) = jax.lax.scan(over_length, init, (hs, ts, ws))
    stats = tuple(_unstrided(x, 1, length) for x in stats)
    grads = (_unstrided(dh, 1, length).astype(hidden.dtype), dk.astype(kernel.dtype),
             None if db is None else db.astype(bias.dtype))
    return jnp.sum(losses), stats, grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(static, hidden, kernel, bias, targets, weights):
    loss, stats, _ = _fused_forward(static, hidden, kernel, bias, targets, weights)
    return loss, stats


def _fused_fwd(static, hidden, kernel, bias, targets, weights):
    loss, stats, grads = _fused_forward(static, hidden, kernel, bias, targets, weights)
    return (loss, stats), grads


def _fused_bwd(static, grads, cotangents):
    """The forward's gradients scaled by the loss's cotangent (the statistics' are dropped:
    ``weighted_nll`` returns them as metrics)."""
    g = cotangents[0]
    scale = lambda x: None if x is None else (x * g.astype(jnp.float32)).astype(x.dtype)
    return (*map(scale, grads), None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)
