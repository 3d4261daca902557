"""Attention: rotary positions, masks, and the ``Attention`` block with its KV cache.

One ``Attention`` serves every family: MHA/GQA/MQA, rotary embeddings (per layer: the global
base, Gemma 3's local one, or none), sliding windows, packed segments, soft-capped logits,
attention sinks (GPT-OSS: a learned logit per head in the softmax, in plain XLA attention),
biases, qk-norm (before or after rotary), Granite's and Gemma's scales, context parallelism (ring attention, through
the explicit ``placement``), and decoding from a cache whose arrays carry logical axes. Training and
scoring calls run XLA, cuDNN or Pallas splash attention (``attention_kernel``; models/splash.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from shardzoo.models import ModelError, splash
from shardzoo.models.arch import ROPE_SCALING
from shardzoo.models.layers import Linear, RMSNorm, constrain, dtype_of, fused, linear_kw, make_norm
from shardzoo.models.ring_attention import ring_attention
from shardzoo.models.splash import splash_attention
from shardzoo.sharding import axes as ax


# ----------------------------------------------------------------------------------- rotary
def _scaling(config, local: bool) -> dict:
    """The layer's ``rope_scaling`` (none for a local layer with its own base: Gemma 3)."""
    return {} if local and config.rope_local_base_freq else config.rope_scaling_dict


def rope_inv_freq(config, local: bool = False, long: bool = False) -> np.ndarray:
    """Inverse frequencies of the rotary embedding, float32, as Hugging Face computes them.

    Handles ``partial_rotary_factor`` (latent attention: ``qk_rope_head_dim``) and every ``rope_scaling`` type of ``arch.ROPE_SCALING``,
    each as ``transformers.modeling_rope_utils`` computes it at initialisation: linear, llama3,
    yarn, longrope (its ``short_factor``; ``long``: its ``long_factor``) and dynamic (plain
    within ``max_position_embeddings``; beyond, ``rope_frequencies`` rescales per call).
    A ``local`` layer with ``rope_local_base_freq`` set uses that base, unscaled (Gemma 3).
    ``config`` is the architecture record.
    """
    dim = config.rope_dim  # head_dim x partial_rotary_factor; latent attention: qk_rope_head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    local_base = config.rope_local_base_freq if local else None
    theta = local_base or config.rope_theta
    pos_freqs = np.float32(theta) ** exponents
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    scaling = _scaling(config, local)
    kind = scaling.get("rope_type", "default")
    if kind in ("default", "dynamic"):
        return inv_freq
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "longrope":
        factors = np.asarray(scaling["long_factor" if long else "short_factor"], np.float32)
        return (np.float32(1.0) / (factors * pos_freqs)).astype(np.float32)
    if kind == "yarn":
        return _yarn_inv_freq(scaling, dim, theta, pos_freqs)
    if kind != "llama3":
        raise NotImplementedError(f"rope_scaling type {kind!r} (supported: default, {', '.join(ROPE_SCALING)})")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
    if high == low:  # no band between (Llama 4 Scout): transformers' smoothing divides by zero, unused
        return scaled.astype(np.float32)
    smooth = (np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(scaling, dim, theta, pos_freqs):
    """YaRN: interpolated (/ factor) below the correction range, extrapolated (as trained) above,
    a linear ramp between (``_compute_yarn_parameters``)."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = np.float32(1) - ramp.astype(np.float32)
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)


def _yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(config, local: bool = False) -> float:
    """The factor of the rotary cos and sin (so of the rotated features of q and k): YaRN's and
    longrope's ``attention_factor``, given or as transformers derives it; 1 otherwise."""
    scaling = _scaling(config, local)
    kind = scaling.get("rope_type", "default")
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / old_len
    if kind == "longrope":
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def rope_frequencies(config, positions, local: bool = False):
    """The layer's inverse frequencies for this call's ``positions`` [batch, length], and the
    cos/sin factor. Static for most types; two depend on the longest position, as in
    transformers' ``dynamic_rope_update``: longrope takes its long factors when any position is
    at or past ``original_max_position_embeddings`` (else the short ones), dynamic NTK raises
    the base to ``theta * (factor * S / max_position_embeddings - factor + 1) ** (d / (d - 2))``
    for ``S = max(positions) + 1`` beyond ``max_position_embeddings``."""
    scaling = _scaling(config, local)
    kind = scaling.get("rope_type", "default")
    inv_freq = rope_inv_freq(config, local)
    if kind not in ("longrope", "dynamic"):
        return inv_freq, rope_attention_factor(config, local)
    seq_len = jnp.max(positions) + 1
    if kind == "longrope":
        beyond = seq_len > scaling["original_max_position_embeddings"]
        return jnp.where(beyond, rope_inv_freq(config, local, long=True), inv_freq), rope_attention_factor(config, local)
    dim, max_len = 2 * inv_freq.shape[0], config.max_position_embeddings
    factor = scaling["factor"]
    grown = jnp.maximum(seq_len, max_len).astype(jnp.float32)
    base = config.rope_theta * (factor * grown / max_len - (factor - 1)) ** (dim / (dim - 2))
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    return jnp.where(seq_len > max_len, 1.0 / base ** exponents, inv_freq), 1.0


def check_rope_decoding(config, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse a longrope generation whose prefill is within ``original_max_position_embeddings``
    and whose later steps pass it: transformers (Phi-3) then recomputes the whole cache with the
    long factors, which a cache of short-rotated keys cannot do."""
    scaling = config.rope_scaling_dict
    if scaling.get("rope_type") == "longrope":
        old_len = scaling["original_max_position_embeddings"]
        if prompt_len <= old_len < prompt_len + max_new_tokens - 1:
            raise ModelError(f"longrope: a prompt of {prompt_len} tokens and {max_new_tokens} new ones cross "
                             f"original_max_position_embeddings={old_len} (short to long factors), which "
                             "decoding from a cache does not do; give a prompt beyond it or fewer new tokens")


def apply_rope(x, positions, inv_freq, attention_factor: float = 1.0, interleaved: bool = False):
    """Rotate the first ``2 * len(inv_freq)`` features of ``x``: feature i with i + rot/2
    (rotate-half, as HF Llama) or, ``interleaved``, feature 2i with 2i + 1 (as HF Cohere, which
    also turns them in float32); cos and sin times ``attention_factor`` (YaRN's, longrope's; as
    transformers).

    x: [batch, length, heads, head_dim]; positions: [batch, length].
    """
    rot = 2 * inv_freq.shape[0]
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [batch, length, rot/2]
    if interleaved:
        emb = jnp.repeat(freqs, 2, axis=-1)[:, :, None, :]  # [batch, length, 1, rot]: f0 f0 f1 f1 ...
    else:
        emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [batch, length, 1, rot]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if interleaved:
        x_rot, cos, sin = x_rot.astype(jnp.float32), cos.astype(jnp.float32), sin.astype(jnp.float32)
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = jnp.stack([-x2, x1], axis=-1).reshape(x_rot.shape)  # (-x1, x0, -x3, x2, ...)
    else:
        x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
        rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = (x_rot * cos + rotated * sin).astype(x.dtype)
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


# -------------------------------------------------------------------------------- attention
def attention_mask(q_slots, k_slots, q_segments, k_segments, sliding_window, chunk=None):
    """Boolean mask [batch, 1, q_len, k_len]: causal, same segment, within the window or chunk.

    Slots are each token's index in its row (cache slot when decoding); a query at i sees a
    key at j when j <= i, i - j < sliding_window, i // chunk == j // chunk (chunked
    attention: Llama 4's attention_chunk_size), and their segment ids are equal.
    """
    i, j = q_slots[:, None, :, None], k_slots[:, None, None, :]
    mask = j <= i
    if sliding_window:
        mask &= i - j < sliding_window
    if chunk:
        mask &= i // chunk == j // chunk
    if q_segments is not None:
        mask &= q_segments[:, None, :, None] == k_segments[:, None, None, :]
    return mask


def l2_norm(x, eps: float):
    """Each head's features over their root mean square, no weight, in float32 (Llama 4's
    ``Llama4TextL2Norm``). x: [batch, length, heads, head_dim]."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def temperature_tuned(q, positions, floor_scale: float, attn_scale: float):
    """Queries at position p times ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``:
    Llama 4's attention temperature on its NoPE layers (transformers takes p from the cache
    index, the same for unpacked rows). q: [batch, length, heads, head_dim]."""
    p = positions.astype(jnp.float32)
    scale = jnp.log1p(jnp.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0  # [batch, length]
    return (q * scale[:, :, None, None]).astype(q.dtype)


def attention_kernel(config, dtype, length):
    """"xla", "cudnn" or "splash" for a layer's attention over rows of ``length``: ``auto`` takes
    splash on a TPU, cuDNN on a GPU, where each can; splash leaves lengths it cannot tile to XLA."""
    impl = config.execution.attention_impl
    if impl == "auto":
        backend, head = jax.default_backend(), config.arch.head_size
        fits = head % 8 == 0 and head <= 256  # cuDNN flash attention's limits
        if backend == "tpu" and not splash.serves(config.arch):
            impl = "splash"
        else:
            impl = "cudnn" if backend == "gpu" and fits and dtype in (jnp.bfloat16, jnp.float16) else "xla"
    return "xla" if impl == "splash" and splash.block_size(length) is None else impl


def softcap(x, cap):
    """``cap * tanh(x / cap)``: values squashed smoothly into (-cap, cap) (Gemma 2)."""
    return cap * jnp.tanh(x / cap)


def xla_attention(q, k, v, mask, scale, logit_cap=None, sinks=None):
    """Attention in plain XLA ops, for what ``jax.nn.dot_product_attention`` cannot take
    (soft-capped logits, sinks): scores scaled, capped, masked, softmax in float32 (as HF's eager).

    q: [batch, q_len, heads, head_dim]; k, v: [batch, k_len, kv_heads, head_dim];
    mask: bool [batch, 1, q_len, k_len]. Query heads are grouped over their kv head (GQA).
    ``sinks`` [heads]: each head's learned logit, one more column of the softmax that attends
    no value (GPT-OSS): the weights of the keys sum to less than 1.
    """
    batch, length, heads, dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, length, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("blkgd,bmkd->bkglm", q, k) * jnp.asarray(scale, q.dtype)
    # [batch, kv_heads, group, q_len, k_len]
    if logit_cap:
        scores = softcap(scores, jnp.asarray(logit_cap, scores.dtype))
    scores = jnp.where(mask[:, :, None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    else:  # [batch, kv_heads, group, q_len, k_len + 1]: the sink last, dropped after the softmax
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, heads // kv_heads, 1, 1),
                                scores.shape[:-1] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
    ctx = jnp.einsum("bkglm,bmkd->blkgd", probs, v)
    return ctx.reshape(batch, length, heads, v.shape[-1])  # [batch, length, heads, head_dim]


def one_query_attention(q, k, v, mask, scale):
    """Attention of one new token per row over the cache (a decoding step) as multiply-and-sum
    over the cache's own layout: a dot_general would transpose the whole cache to put its
    batch and head axes first, every layer and every step. Softmax in float32.

    q: [batch, 1, heads, head_dim]; k, v: [batch, k_len, kv_heads, head_dim]; mask: bool
    [batch, 1, 1, k_len]. Returns [batch, 1, heads, head_dim].
    """
    batch, _, heads, dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, 1, kv_heads, heads // kv_heads, dim) * jnp.asarray(scale, q.dtype)
    scores = jnp.sum(q * k[:, :, :, None, :], axis=-1, dtype=jnp.float32)  # [batch, k_len, kv_heads, group]
    scores = jnp.where(mask[:, 0, 0, :, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=1).astype(v.dtype)
    ctx = jnp.sum(probs[..., None] * v[:, :, :, None, :], axis=1)  # [batch, kv_heads, group, head_dim]
    return ctx.reshape(batch, 1, heads, v.shape[-1])


class Attention(nn.Module):
    """Multi-head attention with MHA/GQA/MQA, rotary positions, windows, segments, a KV cache.

    ``spec`` is the layer's (``arch.LayerSpec``): its window and which rotary embedding it uses.
    """

    config: object
    spec: object
    placement: object = None

    def _cached(self, name, shape, axes, dtype):
        return self.variable(
            "cache", name, nn.with_logical_partitioning(jnp.zeros, axes), shape, dtype
        )

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, decode: bool = False):
        a, e, spec, placement = self.config.arch, self.config.execution, self.spec, self.placement
        if a.latent:
            return self._latent(x, positions, segment_ids, decode)
        dt = dtype_of(e.dtype)
        nh, nkv, hd = a.num_attention_heads, a.kv_heads, a.head_size
        kw = linear_kw(self.config)
        q = Linear((nh, hd), (ax.EMBED, ax.HEADS, ax.HEAD_DIM), a.attention_bias, name="q", **kw)(x)
        kv = [Linear((nkv, hd), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), a.attention_bias, name=n, **kw)
              for n in ("k", "v")]
        k, v = fused(kv, x) if e.fuse_projections else (kv[0](x), kv[1](x))
        if a.key_multiplier != 1.0:  # Falcon-H1: the k projection's output (bias included) scaled
            k = k * jnp.asarray(a.key_multiplier, k.dtype)
        if a.qk_norm not in ("none", "l2") and not a.qk_norm_after_rope:
            q, k = self._qk_norm(q, k)
        if spec.rope != "none":
            inv_freq, factor = rope_frequencies(a, positions, spec.rope == "local")
            turn = a.rope_interleaved
            q, k = apply_rope(q, positions, inv_freq, factor, turn), apply_rope(k, positions, inv_freq, factor, turn)
        if a.qk_norm not in ("none", "l2") and a.qk_norm_after_rope:  # HunYuan: the norm of the rotated heads
            q, k = self._qk_norm(q, k)
        if a.qk_norm == "l2" and spec.rope != "none":  # Llama 4: rotary layers only
            q, k = l2_norm(q, a.rms_norm_eps), l2_norm(k, a.rms_norm_eps)
        if a.attn_temperature_tuning and spec.rope == "none":
            q = temperature_tuned(q, positions, a.floor_scale, a.attn_scale)
        q = checkpoint_name(constrain(q, (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM), placement), "query")
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
        plain = cap or sinks is not None or chunk  # what jax.nn.dot_product_attention cannot compute
        impl = attention_kernel(self.config, dt, length)
        # not under context parallelism (the XLA ring below), nor decoding, nor at init (same params)
        use_splash = impl == "splash" and not (decode or ring or self.is_initializing())
        if decode:
            k, v, mask = self._update_cache(k, v, segment_ids, batch, length, window, chunk)
        elif plain and not use_splash:
            # causality (and chunks) by position, restarting per packed segment, which the
            # segment mask separates: right in any token order, also the ring's zig-zag one under cp
            mask = attention_mask(positions, positions, segment_ids, segment_ids, window, chunk)
        if use_splash:  # windows, chunks and capped logits in the kernel; by position within segments
            ctx = splash_attention(q, k, v, segment_ids, positions, scale=scale, sliding_window=window,
                                   chunk=chunk, logit_cap=cap, placement=placement)
        elif plain:  # jax.nn.dot_product_attention can neither cap the logits, add a sink nor chunk
            ctx = xla_attention(q, k, v, mask, scale, cap, sinks)
        elif decode and length == 1:
            ctx = one_query_attention(q, k, v, mask, scale)
        elif decode:
            ctx = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")
        elif ring and not self.is_initializing():  # context parallelism
            ctx = ring_attention(q, k, v, segment_ids, placement, sliding_window=window, scale=scale,
                                 strategy=e.context_attention)
        else:
            mask = None
            if segment_ids is not None:
                mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
            ctx = jax.nn.dot_product_attention(
                q, k, v, mask=mask, scale=scale, is_causal=True,
                local_window_size=(window - 1, 0) if window else None,
                implementation="xla" if impl == "splash" else impl,
            )
        if a.attn_output_gate:  # Qwen3-Next: the output gated per feature by a second query projection
            gate = Linear((nh, hd), (ax.EMBED, ax.HEADS, ax.HEAD_DIM), a.attention_bias, name="gate", **kw)(x)
            ctx = ctx * jax.nn.sigmoid(gate).astype(ctx.dtype)
        ctx = checkpoint_name(ctx, "attn_context")  # [batch, length, heads, head_dim]
        out = Linear((a.hidden_size,), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), a.attention_out_bias, name="o",
                     **kw)(ctx)
        return checkpoint_name(out, "attn_out")  # [batch, length, embed]

    def _qk_norm(self, q, k):
        """The model's norm of each head: one weight ("head", Qwen3; Phi's LayerNorm) or one per
        head ("heads", Cohere; StableLM's LayerNorm without bias); or of all heads ("projection",
        OLMo 2)."""
        a = self.config.arch
        one, dims, bias = a.qk_norm == "head", 2 if a.qk_norm == "projection" else 1, not a.qk_norm_no_bias
        q = make_norm(self.config, "q_norm", (ax.HEAD_DIM,) if one else (ax.HEADS, ax.HEAD_DIM), dims, bias)(q)
        k = make_norm(self.config, "k_norm", (ax.HEAD_DIM,) if one else (ax.KV_HEADS, ax.HEAD_DIM), dims, bias)(k)
        return q, k

    def _latent(self, x, positions, segment_ids, decode):
        """Multi-head latent attention (DeepSeek-V2/V3; ``TransformerArch.kv_lora_rank``).

        Decoding caches what the keys and values are made of, the normed latent and the rotated
        shared key (kv_lora_rank + qk_rope_head_dim values per token), and expands the whole
        cache per step.
        """
        a, e, spec, placement = self.config.arch, self.config.execution, self.spec, self.placement
        nh, nope, rope_d = a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim
        kw = linear_kw(self.config)
        # transformers builds the latents' norms with RMSNorm's default eps, not rms_norm_eps
        norm = dict(eps=1e-6, dtype=e.dtype, param_dtype=e.param_dtype)
        qk = (ax.HEADS, ax.HEAD_DIM)
        if a.q_lora_rank:
            cq = Linear((a.q_lora_rank,), (ax.EMBED, ax.Q_LORA), name="q_a", **kw)(x)  # [batch, length, q_lora]
            cq = RMSNorm(**norm, axes=(ax.Q_LORA,), name="q_a_norm")(cq)
            q = Linear((nh, nope + rope_d), (ax.Q_LORA, *qk), name="q_b", **kw)(cq)
        else:
            q = Linear((nh, nope + rope_d), (ax.EMBED, *qk), name="q", **kw)(x)  # [batch, length, heads, head_dim]
        c = Linear((a.kv_lora_rank,), (ax.EMBED, ax.KV_LORA), name="kv_a", **kw)(x)  # [batch, length, kv_lora]
        k_rope = Linear((rope_d,), (ax.EMBED, ax.HEAD_DIM), name="k_rope", **kw)(x)[:, :, None]
        # k_rope: [batch, length, 1, head_dim], one rotary key for every head
        c = constrain(RMSNorm(**norm, axes=(ax.KV_LORA,), name="kv_a_norm")(c), (ax.BATCH, ax.LENGTH, ax.KV_LORA),
                      placement)
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
        if a.index_topk:  # DeepSeek Sparse Attention: each query's top-k keys by its indexer (lazily: it imports this)
            from shardzoo.models.sparse_attention import LightningIndexer

            mask = LightningIndexer(self.config, placement, name="indexer")(x, cq, positions, mask, decode)
        kv = Linear((nh, nope + a.v_head_dim), (ax.KV_LORA, *qk), name="kv_b", **kw)(c)
        # kv: [batch, length, heads, head_dim]: per head k_nope then v
        k_nope, v = kv[..., :nope], kv[..., nope:]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:3] + (rope_d,)).astype(k_nope.dtype)], -1)
        k = checkpoint_name(constrain(k, (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM), placement), "key")
        v = checkpoint_name(constrain(v, (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM), placement), "value")
        # value and query/key heads differ in width: the plain XLA attention takes that
        ctx = checkpoint_name(xla_attention(q, k, v, mask, a.attention_scale, a.attn_logit_softcapping),
                              "attn_context")  # [batch, length, heads, head_dim]
        out = Linear((a.hidden_size,), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), a.attention_out_bias, name="o", **kw)(ctx)
        return checkpoint_name(out, "attn_out")  # [batch, length, embed]

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

    def _update_cache(self, k, v, segment_ids, batch, length, window, chunk=None):
        """Write this chunk's keys/values at the cache index; mask over the whole cache."""
        cache_axes = (ax.BATCH, ax.CACHE_LENGTH, ax.KV_HEADS, ax.HEAD_DIM)
        # The cache is created by an init call whose length is the cache length.
        ck = self._cached("cached_key", k.shape, cache_axes, k.dtype)
        cv = self._cached("cached_value", v.shape, cache_axes, v.dtype)
        cseg = self._cached("cached_segment_ids", (batch, length), (ax.BATCH, ax.CACHE_LENGTH), jnp.int32)
        index = self._cached("cache_index", (), (), jnp.int32)  # a scalar (a layers axis when scanned)
        seg = jnp.ones((batch, length), jnp.int32) if segment_ids is None else segment_ids
        i = index.value
        ck.value = jax.lax.dynamic_update_slice(ck.value, k, (0, i, 0, 0))
        cv.value = jax.lax.dynamic_update_slice(cv.value, v, (0, i, 0, 0))
        cseg.value = jax.lax.dynamic_update_slice(cseg.value, seg.astype(jnp.int32), (0, i))
        index.value = i + length
        cache_len = ck.value.shape[1]
        q_slots = jnp.broadcast_to(i + jnp.arange(length), (batch, length))
        k_slots = jnp.broadcast_to(jnp.arange(cache_len), (batch, cache_len))
        # Causality also hides the slots not yet written (j >= i + length).
        mask = attention_mask(q_slots, k_slots, seg, cseg.value, window, chunk)
        return ck.value, cv.value, mask


