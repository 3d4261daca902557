"""The ``Attention`` block with its KV cache, and its component (masks and kernels:
``models/attention_kernels.py``; what it costs: ``models/attention_costs.py``; rotary positions:
``models/rope.py``; multi-head latent attention: ``models/latent_attention.py``).

One ``Attention`` serves every family: MHA/GQA/MQA, rotary embeddings (per layer: the global
base, Gemma 3's local one, or none), sliding windows, packed segments, soft-capped logits,
attention sinks (GPT-OSS: a learned logit per head in the softmax, in plain XLA attention), ALiBi
biases (BLOOM, MPT: ``models/alibi.py``, in plain XLA attention too), MPT's clipped q/k/v,
biases, qk-norm (before or after rotary), Granite's and Gemma's scales, context parallelism (ring attention, through
the explicit ``placement``), and decoding from a cache whose arrays carry logical axes. Training and
scoring calls run XLA, cuDNN or Pallas splash attention (``attention_kernel``; models/splash.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from shardzoo.models import ModelError, check_fields, differential
from shardzoo.models.alibi import alibi_bias
from shardzoo.models.attention_costs import (
    activations,
    cache_bytes,
    decode_flops,
    flops,
    model_terms,
    params,
)
from shardzoo.models.attention_kernels import (
    KEY_CACHE_T_AXES,
    KV_CACHE_AXES,
    attention_kernel,
    attention_mask,
    causal_attention,
    keys_transposed,
    kv_pack,
    one_query_attention,
    packed,
    unpacked,
    xla_attention,
)
from shardzoo.models.component import Mixer, SubRecord
from shardzoo.models.decode_attention import kernel_for, one_query_pallas
from shardzoo.models.latent_attention import LatentAttention, LatentAttentionArch, out_bias
from shardzoo.models.layers import (
    NO_MULTIPLIERS,
    Linear,
    constrain,
    dtype_of,
    fused,
    fuses,
    linear_kw,
    positive,
    scaled,
)
from shardzoo.models.norms import RMSNorm, make_norm
from shardzoo.models.query_scaling import (
    Llama4Scaling,
    TemperatureTuning,
    l2_norm,
    temperature_tuned,
)
from shardzoo.models.ring_attention import ring_attention
from shardzoo.models.rope import apply_rope, rope_frequencies
from shardzoo.models.splash import splash_attention
from shardzoo.sharding import axes as ax

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"  # its layer_types


# -------------------------------------------------------------------------------- attention
@dataclasses.dataclass(frozen=True)
class GlobalAttention(SubRecord):
    """The full-attention layers' own shape beside sliding ones (Gemma 4, MiMo-V2-Flash): their head
    size, key/value heads, keys serving as values and sinks; None: the model's. ``layer_arch`` gives
    such a layer the architecture it computes with."""

    NAME: ClassVar[str] = "global_attention"
    FEATURE: ClassVar[str] = "global_attention"
    FLAT: ClassVar[dict[str, str]] = {"global_head_dim": "head_dim", "num_global_key_value_heads": "num_key_value_heads",
                                      "global_attention_k_eq_v": "k_eq_v", "global_attention_sinks": "sinks"}

    head_dim: int | None = None
    num_key_value_heads: int | None = None
    k_eq_v: bool = False
    sinks: bool | None = None  # attention sinks (MiMo-V2-Flash: on its sliding layers only)

    def check(self, arch) -> None:
        check_fields(self, {}, ("head_dim", "num_key_value_heads"))
        if arch.latent:
            raise ModelError("global_head_dim, num_global_key_value_heads and global_attention_k_eq_v shape "
                             "ordinary attention; latent attention (kv_lora_rank) has its own")
        kv = self.num_key_value_heads or arch.kv_heads
        if arch.num_attention_heads % kv:
            raise ModelError(f"num_attention_heads={arch.num_attention_heads} is not a multiple of "
                             f"num_global_key_value_heads={kv}")


@dataclasses.dataclass(frozen=True)
class ValueHeads(SubRecord):
    """Values shaped apart from the queries and keys (MiMo-V2-Flash): each value head ``head_dim``
    wide (None: as a q/k head) and the values times ``scale`` (its attention_value_scale)."""

    NAME: ClassVar[str] = "value_heads"
    FEATURE: ClassVar[str] = "value_heads"
    FLAT: ClassVar[dict[str, str]] = {"value_head_dim": "head_dim", "attention_value_scale": "scale"}

    head_dim: int | None = None
    scale: float = 1.0

    def check(self, arch) -> None:
        check_fields(self, {}, ("head_dim",))
        if not positive(self.scale):
            raise ModelError(f"attention_value_scale={self.scale!r} must be a finite number > 0")
        g = arch.global_attention
        if self.head_dim and (arch.latent or arch.attention_k_eq_v or (g and g.k_eq_v) or arch.attn_output_gate
                              or arch.diff_attention or arch.sub_norms):
            raise ModelError(f"value_head_dim={self.head_dim} widens ordinary attention's values: latent attention "
                             "has its own, and keys as values (attention_k_eq_v), the output gate, differential "
                             "attention and sub_norms need values as wide as the keys")


def is_global(spec) -> bool:
    """Whether a layer is a full-attention one (no window, no chunk)."""
    return spec.mixer == "attention" and not spec.window and not spec.chunk


@functools.lru_cache(maxsize=256)
def layer_arch(a, spec):
    """The architecture a layer's attention computes with: ``a``, or for a full-attention layer
    of a model with a ``global_attention`` record, ``a`` with that record's head size, key/value
    heads, ``attention_k_eq_v`` and sinks (Gemma 4's global layers, MiMo-V2-Flash's)."""
    g = a.global_attention
    if g is None or not is_global(spec):
        return a
    return dataclasses.replace(a, head_dim=g.head_dim or a.head_size, num_key_value_heads=g.num_key_value_heads or
                               a.kv_heads, attention_k_eq_v=g.k_eq_v or a.attention_k_eq_v,
                               attention_sinks=a.attention_sinks if g.sinks is None else g.sinks, global_attention=None)


class Attention(LatentAttention, nn.Module):
    """Multi-head attention with MHA/GQA/MQA, rotary positions, windows, segments, a KV cache.

    ``spec`` is the layer's (``arch.LayerSpec``): its window and which rotary embedding it uses.
    A subclass picks the query and output projections per token through ``route``, ``query`` and
    ``output`` (``models/moa.py``'s experts).
    """

    config: object
    spec: object
    placement: object = None
    # also return (keys, values, mask) for the layers that reuse them (KV sharing: models/per_layer.py)
    returns_kv: bool = False

    def _cached(self, name, shape, axes, dtype):
        return self.variable(
            "cache", name, nn.with_logical_partitioning(jnp.zeros, axes), shape, dtype
        )

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, decode: bool = False, shared_kv=None):
        """``shared_kv``: an earlier layer's (keys, values, mask) (``returns_kv``), attended in
        place of this layer's own: it has no k and v projections and no cache (KV sharing)."""
        e, spec, placement = self.config.execution, self.spec, self.placement
        a = layer_arch(self.config.arch, spec)  # Gemma 4's full layers: their own head size
        if a.latent:
            return self._latent(x, positions, segment_ids, decode)
        dt = dtype_of(e.dtype)
        nh, hd, vd = a.num_attention_heads, a.head_size, a.v_head_size
        kw = linear_kw(self.config)
        route = self.route(x, segment_ids)
        q = self.query(x, route)  # [batch, length, heads, head_dim]
        if shared_kv is None:
            q, k, v = self._project_kv(a, x, q, positions)
            mask = None
        else:  # KV sharing: the queries alone are this layer's (their norm and rotary)
            q, (k, v, mask) = self._shared_queries(a, q, positions), shared_kv
        if a.attn_temperature_tuning and spec.rope == "none":
            q = temperature_tuned(q, positions, a.attn_temperature_tuning.floor_scale,
                                  a.attn_temperature_tuning.attn_scale)
        if a.llama_4_scaling:  # Ministral 3: every layer, positions from 0
            q = temperature_tuned(q, positions, a.llama_4_scaling.original_max_position_embeddings,
                                  a.llama_4_scaling.beta, offset=0.0)
        q = checkpoint_name(constrain(q, (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM), placement), "query")
        if shared_kv is None:  # (shared ones as they were attended: the cache's layout, decoding)
            k = checkpoint_name(constrain(k, (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM), placement), "key")
            v = checkpoint_name(constrain(v, (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM), placement), "value")
        # [batch, length, heads|kv_heads, head_dim]

        batch, length = x.shape[:2]
        window, chunk, scale, cap = spec.window, spec.chunk, a.attention_scale, a.attn_logit_softcapping
        ring = placement.ring_axes if placement is not None and not decode else ()
        sinks = None
        if a.attention_sinks:  # [heads], in float32 where the softmax is
            sinks = self.param("sinks", nn.with_logical_partitioning(
                nn.initializers.normal(a.initializer_range), (ax.HEADS,)), (nh,), dtype_of(e.param_dtype))
        alibi, diff = a.position_embedding == "alibi", spec.lambda_init is not None  # diff: differential.py
        # what jax.nn.dot_product_attention (and splash) cannot compute: values narrower than the keys too
        plain = cap or sinks is not None or chunk or alibi or diff or vd != hd
        impl = attention_kernel(self.config, dt, length)
        # not under context parallelism (the XLA ring below), nor decoding, nor at init (same params)
        use_splash = impl == "splash" and not (decode or ring or self.is_initializing() or diff)
        q_pos, k_pos, use_kernel = positions, positions, False
        if decode and shared_kv is None:  # ALiBi by cache slot: each row's offset is the same for its query and keys
            k, v, mask, (q_pos, k_pos), layer = self._update_cache(k, v, segment_ids, batch, length, window, chunk)
            # the decoding kernel caps logits and reads chunks from the mask; not sinks, ALiBi, pairs of
            # values, narrower values, nor keys another layer reads (their layout is the XLA path's)
            unserved = sinks is not None or alibi or diff or vd != hd or self.returns_kv
            use_kernel = kernel_for(e, length=length, batch=batch, unserved=unserved, placement=placement,
                                    cache_length=v.shape[-2], keys_t=keys_transposed(e), kv_rows=v.shape[-3]) == "pallas"
            k, v = (k, v) if use_kernel else own_layer(k, v, layer)
            if (plain or length > 1) and not use_kernel:  # the cache's [batch, length, kv_heads, head_dim]
                k, v = unpacked(k, hd, keys_transposed(e)), unpacked(v, vd)
        elif plain and not use_splash and mask is None:  # (a shared mask: the cache's, decoding)
            # causality (and chunks) by position, restarting per packed segment, which the
            # segment mask separates: right in any token order, also the ring's zig-zag one under cp
            mask = attention_mask(positions, positions, segment_ids, segment_ids, window, chunk)
        if diff:  # each query head reads a pair of value heads
            v = differential.paired_values(v)  # [batch, length, kv_heads, 2 head_dim]
        if use_splash:  # windows, chunks and capped logits in the kernel; by position within segments
            ctx = splash_attention(q, k, v, segment_ids, positions, scale=scale, sliding_window=window,
                                   chunk=chunk, logit_cap=cap, placement=placement, block_q=e.splash_block_q)
        elif use_kernel:  # one token over the cache left in HBM, its blocks up to the query's slot
            ctx = one_query_pallas(q, k, v, mask, q_pos[0, 0], scale, keys_t=keys_transposed(e), window=window,
                                   chunk=chunk, logit_cap=cap, layer=layer, block_bytes=e.decode_block_kib * 1024)
        elif plain:  # jax.nn.dot_product_attention can neither cap the logits, add a sink nor chunk
            ctx = xla_attention(q, k, v, mask, scale, cap, sinks, alibi_bias(nh, q_pos, k_pos) if alibi else None)
        elif decode and length == 1:  # over the cache in its own layout
            ctx = one_query_attention(q, k, v, mask, scale, keys_transposed(e))
        elif decode:
            ctx = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")
        elif ring and not self.is_initializing():  # context parallelism
            ctx = ring_attention(q, k, v, segment_ids, placement, sliding_window=window, scale=scale,
                                 strategy=e.context_attention)
        else:
            ctx = causal_attention(q, k, v, segment_ids, window, scale, "xla" if impl == "splash" else impl)
        if diff:
            ctx = differential.differential(self, ctx, spec.lambda_init, a.rms_norm_eps, e.param_dtype,
                                            a.initializer_range)
        if a.attn_output_gate:  # Qwen3-Next: the output gated per feature by a second query projection
            gate = Linear((nh, hd), (ax.EMBED, ax.HEADS, ax.HEAD_DIM), a.attention_bias, name="gate", **kw)(x)
            ctx = ctx * jax.nn.sigmoid(gate).astype(ctx.dtype)
        if a.sub_norms:  # BitNet's attn_sub_norm: all heads' features normed together
            ctx = make_norm(self.config, "sub_norm", (ax.HEADS, ax.HEAD_DIM), dims=2)(ctx)
        ctx = checkpoint_name(self._head_gate(x, ctx), "attn_context")  # [batch, length, heads, head_dim]
        out = checkpoint_name(self.output(ctx, route), "attn_out")  # [batch, length, embed]
        return (out, (k, v, mask)) if self.returns_kv else out

    def route(self, x, segment_ids):
        """What a subclass chooses the projections by, per token (models/moa.py: its experts); here None."""
        return None

    def query(self, x, route):
        """The query projection of ``x``: [batch, length, heads, head_dim]."""
        a = layer_arch(self.config.arch, self.spec)
        return Linear((a.num_attention_heads, a.head_size), (ax.EMBED, ax.HEADS, ax.HEAD_DIM), a.attention_bias,
                      name="q", **linear_kw(self.config))(x)

    def output(self, ctx, route):
        """The output projection of ``ctx`` [batch, length, heads, head_dim]: [batch, length, embed]."""
        a = layer_arch(self.config.arch, self.spec)
        return Linear((a.hidden_size,), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), out_bias(a, self.spec), name="o",
                      **linear_kw(self.config))(ctx)

    def _shared_queries(self, a, q, positions):
        """The queries of a layer attending shared keys: its q-norm ("head") and rotary."""
        if a.qk_norm not in ("none", "head") or a.qk_norm_after_rope:
            raise ModelError(f"KV sharing: qk_norm={a.qk_norm!r} (after rotary: {a.qk_norm_after_rope}) is not "
                             "supported; 'head' or none")
        if a.qk_norm == "head":
            q = make_norm(self.config, "q_norm", (ax.HEAD_DIM,), 1)(q)
        if self.spec.rope != "none":
            inv_freq, factor = rope_frequencies(a, positions, self.spec.rope == "local")
            q = apply_rope(q, positions, inv_freq, factor, a.rope_interleaved)
        return q

    def _project_kv(self, a, x, q, positions):
        """This layer's keys and values of ``x`` (and ``q`` normed and rotated with them)."""
        e, spec = self.config.execution, self.spec
        nkv, hd, vd, kw = a.kv_heads, a.head_size, a.v_head_size, linear_kw(self.config)
        kv = [Linear((nkv, d), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), a.attention_bias, name=n, **kw)
              for n, d in (("k", hd), ("v", vd))[:2 - a.attention_k_eq_v]]
        if a.attention_k_eq_v:  # Gemma 4: the keys' projection serves as the values
            k = v = kv[0](x)
        else:
            k, v = fused(kv, x) if fuses(e) and vd == hd else (kv[0](x), kv[1](x))
        if a.clip_qkv:  # OLMo 1, MPT: the projections' outputs clipped to [-clip_qkv, clip_qkv]
            q, k, v = (jnp.clip(t, -a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        k = scaled(k, (a.multipliers or NO_MULTIPLIERS).key)  # Falcon-H1: the k projection's output (bias included)
        v = scaled(v, a.value_heads.scale) if a.value_heads else v  # MiMo-V2-Flash: the v projection's output
        if a.qk_norm not in ("none", "l2") and not a.qk_norm_after_rope:
            q, k = self._qk_norm(q, k)
        if a.v_norm:  # Gemma 4: each value head RMS-normalised, no weight
            v = RMSNorm(a.rms_norm_eps, e.dtype, e.param_dtype, (ax.HEAD_DIM,), use_scale=False, name="v_norm")(v)
        if spec.rope != "none":
            inv_freq, factor = rope_frequencies(a, positions, spec.rope == "local")
            turn = a.rope_interleaved
            q, k = apply_rope(q, positions, inv_freq, factor, turn), apply_rope(k, positions, inv_freq, factor, turn)
        if a.qk_norm not in ("none", "l2") and a.qk_norm_after_rope:  # HunYuan: the norm of the rotated heads
            q, k = self._qk_norm(q, k)
        if a.qk_norm == "l2" and spec.rope != "none":  # Llama 4: rotary layers only
            q, k = l2_norm(q, a.rms_norm_eps), l2_norm(k, a.rms_norm_eps)
        return q, k, v

    def _head_gate(self, x, ctx):
        """``ctx`` [batch, length, heads, head_dim] times sigmoid(x . w) per head (``attn_head_gate``:
        Ling's ``g_proj``, LFM3's ``gate_proj``; in float32, rounded to ctx's dtype), else as it is."""
        if not self.config.arch.attn_head_gate:
            return ctx
        gate = Linear((self.config.arch.num_attention_heads,), (ax.EMBED, ax.HEADS), name="head_gate",
                      **linear_kw(self.config))(x)  # [batch, length, heads]
        return ctx * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(ctx.dtype)[..., None]

    def _qk_norm(self, q, k):
        """The model's norm of each head: one weight ("head", Qwen3; Phi's LayerNorm) or one per
        head ("heads", Cohere; StableLM's LayerNorm without bias); or of all heads ("projection",
        OLMo 2)."""
        a = self.config.arch
        one, dims, bias = a.qk_norm == "head", 2 if a.qk_norm == "projection" else 1, not a.qk_norm_no_bias
        q = make_norm(self.config, "q_norm", (ax.HEAD_DIM,) if one else (ax.HEADS, ax.HEAD_DIM), dims, bias)(q)
        k = make_norm(self.config, "k_norm", (ax.HEAD_DIM,) if one else (ax.KV_HEADS, ax.HEAD_DIM), dims, bias)(k)
        return q, k

    def _update_cache(self, k, v, segment_ids, batch, length, window, chunk=None):
        """Write this chunk's keys/values at the cache index; the whole cache's keys and values
        ([batch, kv_heads, cache_length, head_dim]: ``KV_CACHE_AXES``; the keys transposed where
        ``keys_transposed``), its mask, the slots of the queries and of the cache's keys, and the
        layer: None, or where the keys and values are a scanned stack's (``cache_layer``, models/decode.py
        ``stacked_kv``), written and returned whole, this layer's index in it."""
        # The cache is created by an init call whose length is the cache length.
        pack = kv_pack(self.config.execution, k.shape[-1], k.shape[2]) if k.shape[-1] == v.shape[-1] else 1
        k, v = packed(k, pack), packed(v, pack)
        keys_t = keys_transposed(self.config.execution)
        k = jnp.swapaxes(k, 2, 3) if keys_t else k
        ck = self._cached("cached_key", k.shape, KEY_CACHE_T_AXES if keys_t else KV_CACHE_AXES, k.dtype)
        cv = self._cached("cached_value", v.shape, KV_CACHE_AXES, v.dtype)
        cseg = self._cached("cached_segment_ids", (batch, length), (ax.BATCH, ax.CACHE_LENGTH), jnp.int32)
        index = self._cached("cache_index", (), (), jnp.int32)  # a scalar (a layers axis when scanned)
        seg = jnp.ones((batch, length), jnp.int32) if segment_ids is None else segment_ids
        i = index.value
        cache_len = cv.value.shape[-2]
        q_slots = jnp.broadcast_to(i + jnp.arange(length), (batch, length))
        k_slots = jnp.broadcast_to(jnp.arange(cache_len), (batch, cache_len))
        # Causality also hides the slots not yet written (j >= i + length).
        layer = self.get_variable("cache", "cache_layer")  # None but in a stack (models/decode.py)
        at = () if layer is None else (layer,)
        k, v = (t if layer is None else t[None] for t in (k, v))
        ck.value = jax.lax.dynamic_update_slice(ck.value, k, at + ((0, 0, 0, i) if keys_t else (0, 0, i, 0)))
        cv.value = jax.lax.dynamic_update_slice(cv.value, v, at + (0, 0, i, 0))
        cseg.value = jax.lax.dynamic_update_slice(cseg.value, seg.astype(jnp.int32), (0, i))
        index.value = i + length
        mask = attention_mask(q_slots, k_slots, seg, cseg.value, window, chunk)
        return ck.value, cv.value, mask, (q_slots, k_slots), layer


def own_layer(k, v, layer):
    """A scanned stack's keys and values (``_update_cache``'s ``layer`` not None): this layer's."""
    if layer is None:
        return k, v
    return tuple(jax.lax.dynamic_index_in_dim(t, layer, keepdims=False) for t in (k, v))


# ------------------------------------------------------------------------------ the component

def _apply(block, h, positions, segment_ids):
    """Attention of ``h``, its input and output scaled by the attention multipliers (Falcon-H1's; 1 elsewhere)."""
    m = block.config.arch.multipliers or NO_MULTIPLIERS
    out = Attention(block.config, block.spec, block.placement, name="attn")(
        scaled(h, m.attention_in), positions, segment_ids, block.decode)
    return scaled(out, m.attention_out)


def check(a) -> None:
    """Differential attention's heads; latent attention's sizes, and what it has no room for."""
    if a.diff_attention:
        differential.check(a)
    if not a.latent:
        return
    check_fields(a.latent, {}, ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    missing = [n for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if not getattr(a.latent, n)]
    if missing:
        raise ModelError(f"latent attention (kv_lora_rank={a.latent.kv_lora_rank}) needs {', '.join(missing)}")
    if a.latent.lora_scaling and not a.latent.q_lora_rank:
        raise ModelError("lora_scaling rescales the query latent's path: it needs q_lora_rank")
    if a.latent.qk_rope_head_dim % 2:
        raise ModelError(f"rotary embeddings turn pairs of features: qk_rope_head_dim={a.latent.qk_rope_head_dim} is odd")
    if a.kv_heads != a.num_attention_heads:
        raise ModelError(f"latent attention expands keys and values for every query head: num_key_value_heads="
                         f"{a.kv_heads} must be num_attention_heads={a.num_attention_heads}")
    if a.qk_norm != "none" or a.attention_bias or a.partial_rotary_factor != 1.0 or a.attention_sinks or a.clip_qkv:
        raise ModelError("latent attention has no qk_norm, q/k/v biases, attention_sinks, clip_qkv or partial_rotary_factor "
                         "(it rotates qk_rope_head_dim features of each head)")
    if a.attn_output_gate or a.sub_norms:
        raise ModelError("latent attention has no output gate (attn_output_gate: Qwen3-Next's attention) nor "
                         "sub_norms (BitNet's)")
    if a.v_norm or a.attention_k_eq_v:
        raise ModelError("latent attention has no v_norm or attention_k_eq_v (its values come from the latent)")


CONTEXT_PARALLEL = ("ring attention (models/ring_attention.py): the rows in zig-zag order, key/value blocks passed "
                    "round the ring, or gathered whole with context_attention='all_gather'; splash attention takes "
                    "the ring's shards as its own (models/splash.py)")
MIXER = Mixer(
    "attention", (FULL, SLIDING, CHUNKED), _apply, params, flops, decode_flops, activations, model_terms,
    cache_bytes, CONTEXT_PARALLEL, check, (LatentAttentionArch, TemperatureTuning, GlobalAttention,
                                                   ValueHeads, Llama4Scaling))
