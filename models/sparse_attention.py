"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer picks, for each query of
latent attention, the ``topk`` keys it attends. A token mixer (``MIXER``, the "indexed_attention"
layers of ``layer_types``; ``models/components.py``) with its sub-record ``indexer``
(``IndexerArch``; HF's ``index_topk``, ``index_n_heads``, ``index_head_dim``): ``IndexedAttention``
is latent attention (``models/latent_attention.py``) whose ``select_keys`` runs the indexer.

The indexer has its own small projections: ``n_heads`` query heads of ``head_dim`` from the
query latent (``wq_b``), one key of ``head_dim`` per token (``wk``, LayerNorm'd: ``k_norm``) and a
weight per head and token (``weights_proj``); rotary on the first ``qk_rope_head_dim`` features of
both (halves in V3.2, interleaved pairs in GLM-5: ``rope_interleaved``). A key's score for a query
is ``sum_h w[h] / sqrt(n_heads) * relu(q[h] . k / sqrt(head_dim))``, float32, over the keys the
attention's mask allows; each query keeps the keys whose score reaches its ``topk``-th
(``top_k_mask``: keys tied with it are all kept, transformers keeps an arbitrary few of them).
Training and scoring: over the whole row, the mask folded into latent attention's (which still
computes every key: the selection changes the numbers, not yet the cost). Decoding: the
indexer's keys are cached beside the latent (``cached_index_key`` [batch, cache_length,
head_dim], at the latent cache's index) and a new token scores the whole cache. Where a row has
at most ``topk`` keys the indexer selects them all and nothing is scored.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn

from shardzoo.models import ModelError, attention
from shardzoo.models.attention import Attention
from shardzoo.models.component import Mixer, SubRecord
from shardzoo.models.decode import _largest_key, _order_keys
from shardzoo.models.layers import Linear, constrain, linear_kw
from shardzoo.models.norms import LayerNorm
from shardzoo.models.rope import apply_rope, rope_frequencies
from shardzoo.sharding import axes as ax

SPARSE = "sparse_attention"  # the mixer's name (LayerSpec.mixer)
INDEXED = "indexed_attention"  # the layer_types name of its layers (transformers')
KEY_AXES = (ax.BATCH, ax.CACHE_LENGTH, ax.HEAD_DIM)  # the decoding cache of the indexer's keys


def top_k_mask(scores, allowed, k: int):
    """bool [..., k_len]: the keys whose score is at least the ``k``-th largest of the allowed
    ones, and allowed (all allowed keys where fewer than ``k``). Sort-free: the k-th score's
    order key found bit by bit (``models/decode.py``)."""
    keys = _order_keys(jnp.where(allowed, scores, -jnp.inf))
    kth = _largest_key(keys, lambda at_least: at_least.sum(-1) >= k)
    return (keys >= kth) & allowed


def index_scores(q, k, w):
    """The indexer's scores, float32 [batch, q_len, k_len]: ``sum_h w * relu(q_h . k)``.
    q: [batch, q_len, heads, dim] (scaled); k: [batch, k_len, dim]; w: [batch, q_len, heads]."""
    per_head = jnp.einsum("blhd,bmd->blhm", q.astype(jnp.float32), k.astype(jnp.float32))
    return jnp.einsum("blh,blhm->blm", w.astype(jnp.float32), jax.nn.relu(per_head))


class LightningIndexer(nn.Module):
    """The indexer's projections of one latent-attention layer: ``(x, cq, positions)`` -> (q
    [batch, length, heads, head_dim] with its 1/sqrt(head_dim), k [batch, length, head_dim], w
    [batch, length, heads] with its 1/sqrt(heads)). x: the layer's input; cq: the normed query latent."""

    config: object
    placement: object = None

    @nn.compact
    def __call__(self, x, cq, positions):
        a, e = self.config.arch, self.config.execution
        heads, dim = a.indexer.n_heads, a.indexer.head_dim
        kw = linear_kw(self.config)
        q = Linear((heads, dim), (ax.Q_LORA, ax.HEADS, ax.HEAD_DIM), name="wq_b", **kw)(cq)
        k = Linear((dim,), (ax.EMBED, ax.HEAD_DIM), name="wk", **kw)(x)  # [batch, length, head_dim]
        k = LayerNorm(1e-6, e.dtype, e.param_dtype, axes=(ax.HEAD_DIM,), name="k_norm")(k)
        w = Linear((heads,), (ax.EMBED, ax.HEADS), name="weights_proj", **kw)(x)  # [batch, length, heads]
        inv_freq, factor = rope_frequencies(a, positions)
        turn = a.indexer.rope_interleaved
        q = apply_rope(q, positions, inv_freq, factor, turn) * jnp.asarray(dim**-0.5, q.dtype)
        k = apply_rope(k[:, :, None], positions, inv_freq, factor, turn)[:, :, 0]
        q = constrain(q, (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM), self.placement)
        return q, k, w * jnp.asarray(heads**-0.5, w.dtype)


class IndexedAttention(Attention):
    """Latent attention (``models/attention.py``) whose queries see their indexer's top-k keys."""

    def select_keys(self, x, cq, positions, mask, decode):
        """``mask`` narrowed to each query's ``topk`` keys; when decoding, the indexer's keys
        cached beside the latent (``cached_index_key``, at the latent cache's index)."""
        a = self.config.arch
        q, k, w = LightningIndexer(self.config, self.placement, name="indexer")(x, cq, positions)
        if decode:  # the latent cache's index has passed this chunk already
            cached = self._cached("cached_index_key", k.shape, KEY_AXES, k.dtype)
            start = nn.unbox(self.get_variable("cache", "cache_index")) - k.shape[1]
            cached.value = jax.lax.dynamic_update_slice(cached.value, k, (0, start, 0))
            k = cached.value  # [batch, cache_length, head_dim]
        if a.indexer.topk >= mask.shape[-1]:  # every key selected
            return mask
        keep = top_k_mask(jax.lax.stop_gradient(index_scores(q, k, w)), mask[:, 0], a.indexer.topk)
        return mask & keep[:, None]  # [batch, 1, q_len, k_len]


# ------------------------------------------------------------------------ what the rest asks
def _apply(block, h, positions, segment_ids):
    return IndexedAttention(block.config, block.spec, block.placement, name="attn")(h, positions, segment_ids,
                                                                                    block.decode)


def _indexer_params(a) -> int:
    """One layer's indexer parameters: wq_b, wk, k_norm (scale and bias), weights_proj."""
    d, h, dim = a.hidden_size, a.indexer.n_heads, a.indexer.head_dim
    return a.latent.q_lora_rank * h * dim + d * dim + 2 * dim + d * h


def _indexer_flops(a, keys: float) -> float:
    """Forward FLOPs per token of one layer's indexer (no backward: no gradient reaches it): its
    projections, and where it selects (``keys`` > 0) the scores of ``keys`` keys, ``heads *
    dim`` multiply-adds each, and their weighting."""
    h, dim = a.indexer.n_heads, a.indexer.head_dim
    return 2 * (_indexer_params(a) - 2 * dim) + 2 * keys * h * (dim + 1)


def params(a) -> tuple[int, int]:
    """Latent attention's, and the indexer's (with the norms: it is not multiplied 6 times a token)."""
    matmul, other = attention.params(a)
    return matmul, other + _indexer_params(a)


def flops(a, spec, seq_len: int) -> float:
    """Latent attention's q.k and p.v (dense: the selection is a mask), and the indexer's forward."""
    keys = seq_len / 2 if a.indexer.topk < seq_len else 0
    return attention.flops(a, spec, seq_len) + _indexer_flops(a, keys)


def decode_flops(a, spec, context: float) -> float:
    """Latent attention's over the ``context`` keys, and the indexer's (its scores where it selects)."""
    return attention.decode_flops(a, spec, context) + _indexer_flops(a, context if a.indexer.topk < context else 0)


def activations(cost, spec=None) -> dict:
    """Latent attention's arrays and, where the indexer selects, the layer's own mask (bool)."""
    out = attention.activations(cost, spec)
    if cost.config.arch.indexer.topk < cost.seq_len:
        out["index_mask"] = cost.t(cost.seq_len, (ax.BATCH, ax.LENGTH), 1)
    return out


def cache_bytes(a, batch: int, length: int, nbytes: int) -> int:
    """Latent attention's cache, and the indexer's keys."""
    return attention.cache_bytes(a, batch, length, nbytes) + batch * length * a.indexer.head_dim * nbytes


@dataclasses.dataclass(frozen=True)
class IndexerArch(SubRecord):
    """The indexer's settings: each query keeps its ``topk`` best keys, scored by ``n_heads`` heads
    of ``head_dim``; ``rope_interleaved``: its rotary turns pairs (GLM-5), not halves (V3.2)."""

    NAME: ClassVar[str] = "indexer"
    FEATURE: ClassVar[str] = "sparse_attention"
    OWNERS: ClassVar[tuple[str, ...]] = (SPARSE,)
    FLAT: ClassVar[dict[str, str]] = {"index_topk": "topk", "index_n_heads": "n_heads", "index_head_dim": "head_dim",
                                      "indexer_rope_interleaved": "rope_interleaved"}

    topk: int | None = None
    n_heads: int | None = None
    head_dim: int | None = None
    rope_interleaved: bool = False

    def check(self, arch) -> None:
        for flat, name in list(self.FLAT.items())[:3]:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"layer_types has {INDEXED} layers: {flat}={value!r} must be an integer >= 1")
        rotated = arch.latent.qk_rope_head_dim if arch.latent else 0
        if self.head_dim < rotated:
            raise ModelError(f"index_head_dim={self.head_dim} must be at least qk_rope_head_dim={rotated} (the "
                             "indexer rotates its first qk_rope_head_dim features)")


def check(a) -> None:
    """Latent attention's checks, with the query latent the indexer reads."""
    latent = a.latent
    if latent is None or not latent.q_lora_rank:
        raise ModelError(f"layer_types has {INDEXED} layers, whose indexer reads latent attention's query latent: "
                         f"set kv_lora_rank and q_lora_rank (kv_lora_rank={latent and latent.kv_lora_rank}, "
                         f"q_lora_rank={latent and latent.q_lora_rank})")
    attention.check(a)


CONTEXT_PARALLEL = ("none of its own, as latent attention's: under the rules' length sharding GSPMD gathers the "
                    "keys (and the indexer's) of the row")
MIXER = Mixer(SPARSE, (INDEXED,), _apply, params, flops, decode_flops, activations, attention.model_terms, cache_bytes,
              CONTEXT_PARALLEL, check, records=(IndexerArch,))
