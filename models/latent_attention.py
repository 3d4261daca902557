"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-Linear, LongCat-Flash): its architecture
record and the ``Attention`` block's latent path (``LatentAttention``, a mixin of
``models/attention.py``'s ``Attention``): queries from x or a query latent, keys and values
expanded per head from one normed kv latent, one rotary key shared by every head; decoding caches
the latents and the rotary keys."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from shardzoo.models.attention_kernels import attention_mask, xla_attention
from shardzoo.models.component import SubRecord
from shardzoo.models.features import feature
from shardzoo.models.layers import Linear, constrain, linear_kw
from shardzoo.models.norms import RMSNorm
from shardzoo.models.rope import apply_rope, rope_frequencies
from shardzoo.sharding import axes as ax


@dataclasses.dataclass(frozen=True)
class LatentAttentionArch(SubRecord):
    """Multi-head latent attention (DeepSeek-V2/V3): q from x (or from a q_lora_rank latent,
    RMSNorm'd); keys and values from one kv_lora_rank latent per token (RMSNorm'd, expanded per
    head to [k_nope, v]) and one qk_rope_head_dim rotary key shared by all heads; rotary on the
    queries' and keys' last qk_rope_head_dim features only."""

    NAME: ClassVar[str] = "latent"
    FEATURE: ClassVar[str] = "latent_attention"
    FLAT: ClassVar[dict[str, str]] = {n: n for n in (
        "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "lora_scaling")}

    kv_lora_rank: int | None = None  # None: ordinary attention
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # the queries times sqrt(hidden_size / q_lora_rank) and the normed kv latent (so keys' nope
    # features and values) times sqrt(hidden_size / kv_lora_rank) (LongCat-Flash's mla_scale_*_lora)
    lora_scaling: bool = feature(False, "latent_lora_scaling")

    def used(self, arch) -> bool:
        return self.kv_lora_rank is not None


def out_bias(a, spec) -> bool:
    """Whether a layer's output projection has a bias: its own (attention_out_bias_layers), else the model's."""
    return a.attention_out_bias if spec.out_bias is None else spec.out_bias


class LatentAttention:
    """The latent path of ``Attention`` (which mixes it in): ``_latent`` when the layer's
    architecture has ``latent.kv_lora_rank``."""

    def _latent(self, x, positions, segment_ids, decode):
        """Multi-head latent attention (DeepSeek-V2/V3; ``TransformerArch.latent.kv_lora_rank``).

        Decoding caches what the keys and values are made of, the normed latent and the rotated
        shared key (kv_lora_rank + qk_rope_head_dim values per token), and expands the whole
        cache per step.
        """
        a, e, spec, placement = self.config.arch, self.config.execution, self.spec, self.placement
        nh, nope, rope_d = a.num_attention_heads, a.latent.qk_nope_head_dim, a.latent.qk_rope_head_dim
        kw = linear_kw(self.config)
        # transformers builds the latents' norms with RMSNorm's default eps, not rms_norm_eps
        norm = dict(eps=1e-6, dtype=e.dtype, param_dtype=e.param_dtype)
        qk = (ax.HEADS, ax.HEAD_DIM)
        if a.latent.q_lora_rank:
            cq = Linear((a.latent.q_lora_rank,), (ax.EMBED, ax.Q_LORA), name="q_a", **kw)(x)  # [batch, length, q_lora]
            cq = RMSNorm(**norm, axes=(ax.Q_LORA,), name="q_a_norm")(cq)
            q = Linear((nh, nope + rope_d), (ax.Q_LORA, *qk), name="q_b", **kw)(cq)
        else:
            q = Linear((nh, nope + rope_d), (ax.EMBED, *qk), name="q", **kw)(x)  # [batch, length, heads, head_dim]
        c = Linear((a.latent.kv_lora_rank,), (ax.EMBED, ax.KV_LORA), name="kv_a", **kw)(x)  # [batch, length, kv_lora]
        k_rope = Linear((rope_d,), (ax.EMBED, ax.HEAD_DIM), name="k_rope", **kw)(x)[:, :, None]
        # k_rope: [batch, length, 1, head_dim], one rotary key for every head
        c = RMSNorm(**norm, axes=(ax.KV_LORA,), name="kv_a_norm")(c)
        if a.latent.lora_scaling:  # LongCat-Flash: both latents' paths rescaled to the model's width
            q = q * jnp.asarray((a.hidden_size / a.latent.q_lora_rank) ** 0.5, q.dtype)
            c = c * jnp.asarray((a.hidden_size / a.latent.kv_lora_rank) ** 0.5, c.dtype)
        c = constrain(c, (ax.BATCH, ax.LENGTH, ax.KV_LORA), placement)
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        if spec.rope != "none":  # interleaved pairs rotated in place: the same q.k as HF's de-interleave
            inv_freq, factor = rope_frequencies(a, positions, spec.rope == "local")
            turn = a.rope_interleaved
            q_rope = apply_rope(q_rope, positions, inv_freq, factor, turn)
            k_rope = apply_rope(k_rope, positions, inv_freq, factor, turn)
        q = checkpoint_name(constrain(jnp.concatenate([q_nope, q_rope], -1), (ax.BATCH, ax.LENGTH, *qk), placement),
                            "query")
        batch, length = x.shape[:2]
        if decode:
            c, k_rope, mask = self._update_latent_cache(c, k_rope[:, :, 0], segment_ids, batch, length, spec.window,
                                                        spec.chunk)
            k_rope = k_rope[:, :, None]
        else:
            mask = attention_mask(positions, positions, segment_ids, segment_ids, spec.window, spec.chunk)
        mask = self.select_keys(x, cq if a.latent.q_lora_rank else None, positions, mask, decode)
        kv = Linear((nh, nope + a.latent.v_head_dim), (ax.KV_LORA, *qk), name="kv_b", **kw)(c)
        # kv: [batch, length, heads, head_dim]: per head k_nope then v
        k_nope, v = kv[..., :nope], kv[..., nope:]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:3] + (rope_d,)).astype(k_nope.dtype)], -1)
        k = checkpoint_name(constrain(k, (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM), placement), "key")
        v = checkpoint_name(constrain(v, (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM), placement), "value")
        # value and query/key heads differ in width: the plain XLA attention takes that
        ctx = checkpoint_name(self._head_gate(x, xla_attention(q, k, v, mask, a.attention_scale,
                                                               a.attn_logit_softcapping)),
                              "attn_context")  # [batch, length, heads, head_dim]
        out = Linear((a.hidden_size,), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), out_bias(a, self.spec), name="o", **kw)(ctx)
        return checkpoint_name(out, "attn_out")  # [batch, length, embed]

    def select_keys(self, x, cq, positions, mask, decode):
        """The keys each query of latent attention sees: ``mask`` (bool [batch, 1, q_len, k_len]) as
        it is; a subclass narrows it (``models/sparse_attention.py``). cq: the normed query latent."""
        return mask

    def _update_latent_cache(self, c, k_rope, segment_ids, batch, length, window, chunk=None):
        """Write this chunk's latents and rotary keys at the cache index; mask over the whole cache."""
        cc = self._cached("cached_latent", c.shape, (ax.BATCH, ax.CACHE_LENGTH, ax.KV_LORA), c.dtype)
        cr = self._cached("cached_rope_key", k_rope.shape, (ax.BATCH, ax.CACHE_LENGTH, ax.HEAD_DIM), k_rope.dtype)
        cseg = self._cached("cached_segment_ids", (batch, length), (ax.BATCH, ax.CACHE_LENGTH), jnp.int32)
        index = self._cached("cache_index", (), (), jnp.int32)
        seg = jnp.ones((batch, length), jnp.int32) if segment_ids is None else segment_ids
        i = index.value
        cc.value = jax.lax.dynamic_update_slice(cc.value, c, (0, i, 0))
        cr.value = jax.lax.dynamic_update_slice(cr.value, k_rope, (0, i, 0))
        cseg.value = jax.lax.dynamic_update_slice(cseg.value, seg.astype(jnp.int32), (0, i))
        index.value = i + length
        cache_len = cc.value.shape[1]
        q_slots = jnp.broadcast_to(i + jnp.arange(length), (batch, length))
        k_slots = jnp.broadcast_to(jnp.arange(cache_len), (batch, cache_len))
        return cc.value, cr.value, attention_mask(q_slots, k_slots, seg, cseg.value, window, chunk)
