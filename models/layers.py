"""Pieces the model families share: norms, embeddings, rotary positions, attention, MLPs.

Modules take the family's config (fields named as ``TransformerConfig``'s, i.e. Hugging Face's).
Every parameter names every dimension with the logical vocabulary of ``sharding.axes``; the
modules never name a mesh axis.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from shardzoo.models.lora import linear_lora
from shardzoo.models.ring_attention import ring_attention, ring_axes
from shardzoo.sharding import axes as ax


def dtype_of(name) -> jnp.dtype:
    """``"bfloat16"`` (or a dtype) to a jnp dtype."""
    return jnp.dtype(name)


# (sites, apply) while ``recording_constraints`` is active, else None.
_RECORDER: contextvars.ContextVar = contextvars.ContextVar("shardzoo_constraints", default=None)


@contextlib.contextmanager
def recording_constraints(apply: bool = True):
    """Record every ``constrain`` traced inside the block: a list of ``(path, names, shape, dtype)``.

    The path is the calling module's (``layers_0/attn``) and the site's index among that
    module's constraints (``layers_0/attn#1``). With ``apply=False`` the constraints are only
    recorded (enough for ``eval_shape`` of ``init``), so a rule that would fail inside jax is
    reported by the validator instead. Repeated traces of one site (scan, remat) count once.
    """
    seen: list[tuple] = []
    token = _RECORDER.set((seen, apply))
    sites: list[tuple] = []
    try:
        yield sites
    finally:
        _RECORDER.reset(token)
        count: dict[str, int] = {}
        for path, names, shape, dtype in seen:
            sites.append((f"{path}#{count.get(path, 0)}", names, shape, dtype))
            count[path] = count.get(path, 0) + 1


def _module_path() -> str:
    # flax has no public accessor for the module whose method is running; its module stack is
    # the one place that knows, read here only to name a recorded site.
    from flax.linen import module as flax_module

    stack = flax_module._context.module_stack
    top = stack[-1] if stack else None
    if top is None:
        return ""
    path = "/".join(str(p) for p in top.path) if top.scope is not None else ""
    return path or type(top).__name__


def constrain(x, axes):
    """Constrain an activation's sharding by logical names (a no-op outside a mesh).

    The one place every activation constraint of the zoo goes through.
    """
    axes = tuple(axes)
    recorder = _RECORDER.get()
    if recorder is not None:
        seen, apply = recorder
        key = (_module_path(), axes, tuple(x.shape), str(x.dtype))
        if key not in seen:
            seen.append(key)
        named = [n for n in axes if isinstance(n, str)]
        if not apply or len(set(named)) < len(named):  # a name twice: report, don't raise in flax
            return x
    return nn.with_logical_constraint(x, axes)


def _normal(config):
    return nn.initializers.normal(stddev=config.initializer_range)


# ---------------------------------------------------------------------------------------- norms
class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama), computed in float32 like Hugging Face's.

    It normalizes over the last ``len(axes)`` dimensions of ``x`` (named ``axes``): the model
    width, one head's features (Qwen3's qk-norm) or all heads' (OLMo 2's).
    """

    eps: float = 1e-6
    dtype: str = "float32"
    param_dtype: str = "float32"
    axes: tuple[str, ...] = (ax.EMBED,)
    plus_one: bool = False  # scale by (1 + weight), weight zero-initialized (Gemma)

    @nn.compact
    def __call__(self, x):
        dims = tuple(range(x.ndim - len(self.axes), x.ndim))
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = self.param(
            "scale", nn.with_logical_partitioning(init, self.axes), x.shape[dims[0]:],
            dtype_of(self.param_dtype),
        )
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=dims, keepdims=True) + self.eps)
        scale32 = scale.astype(jnp.float32)
        return (y * (1.0 + scale32 if self.plus_one else scale32)).astype(dtype_of(self.dtype))


class LayerNorm(nn.Module):
    """Layer norm with scale and bias (GPT-2), computed in float32."""

    eps: float = 1e-5
    dtype: str = "float32"
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        shape, pdt = (x.shape[-1],), dtype_of(self.param_dtype)
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (ax.EMBED,)), shape, pdt)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (ax.EMBED,)), shape, pdt)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale + bias).astype(dtype_of(self.dtype))


def make_norm(config, name: str) -> nn.Module:
    """The config's norm (``norm_type`` "rmsnorm", "rmsnorm_plus_one" or "layernorm") as a
    named submodule."""
    if config.norm_type == "layernorm":
        return LayerNorm(config.rms_norm_eps, config.dtype, config.param_dtype, name=name)
    return RMSNorm(config.rms_norm_eps, config.dtype, config.param_dtype,
                   plus_one=config.norm_type == "rmsnorm_plus_one", name=name)


# ------------------------------------------------------------------------------- linear, embed
class Linear(nn.Module):
    """``y = x · kernel (+ bias)``; the kernel is (inputs..., features...) with named axes.

    ``axes`` names the kernel's dimensions; its last ``len(features)`` are the outputs, the rest
    contract with the last dimensions of ``x``. (Not ``nn.DenseGeneral``: see JAX_NOTES.)
    ``weights`` creates (or reads) the parameters without applying them, for ``fused``.
    ``lora`` ``(rank, scale, targets)``: a linear whose name is in ``targets`` also has LoRA
    adapters (``models/lora.py``) and adds ``scale * (x A) B``.
    """

    features: tuple[int, ...]
    axes: tuple[str, ...]
    use_bias: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    init_std: float = 0.02
    lora: tuple = ()

    @property
    def n_in(self) -> int:
        return len(self.axes) - len(self.features)

    @nn.compact
    def weights(self, in_shape: tuple[int, ...]):
        """(kernel, bias or None, adapter or None) in the compute dtype; ``in_shape`` is the
        contracted dims; the adapter is ``(A, B, scale)``."""
        init = nn.initializers.normal(stddev=self.init_std)
        pdt, dt = dtype_of(self.param_dtype), dtype_of(self.dtype)
        shape = tuple(in_shape) + tuple(self.features)
        kernel = self.param("kernel", nn.with_logical_partitioning(init, self.axes), shape, pdt)
        bias = None
        if self.use_bias:
            bias = self.param(
                "bias", nn.with_logical_partitioning(nn.initializers.zeros, self.axes[self.n_in:]),
                tuple(self.features), pdt,
            ).astype(dt)
        adapter = None
        if self.lora and self.name in self.lora[2]:  # float32 adapters, whatever the base's dtype
            rank, scale, _ = self.lora
            bound = 1.0 / math.sqrt(math.prod(in_shape))  # PEFT: kaiming_uniform(a=sqrt(5))
            a_init = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
            a = self.param("lora_a", nn.with_logical_partitioning(a_init, self.axes[:self.n_in] + (ax.LORA_RANK,)),
                           tuple(in_shape) + (rank,), jnp.float32)
            b = self.param("lora_b", nn.with_logical_partitioning(nn.initializers.zeros, (ax.LORA_RANK,) + self.axes[self.n_in:]),
                           (rank,) + tuple(self.features), jnp.float32)
            adapter = (a.astype(dt), b.astype(dt), scale)
        return kernel.astype(dt), bias, adapter

    def __call__(self, x):
        kernel, bias, adapter = self.weights(x.shape[x.ndim - self.n_in:])
        x = x.astype(dtype_of(self.dtype))
        y = jnp.tensordot(x, kernel, axes=self.n_in)
        y = y if bias is None else y + bias
        return adapted(y, x, adapter, self.n_in)


def adapted(y, x, adapter, n_in: int):
    """``y + scale * (x A) B``: LoRA's low-rank path, never forming ``W + A B``."""
    if adapter is None:
        return y
    a, b, scale = adapter
    h = jnp.tensordot(x, a, axes=n_in) * scale  # [batch..., lora_rank]
    return y + jnp.tensordot(h, b, axes=1)


def fused(linears, x):
    """``[lin(x) for lin in linears]`` as one matmul; the linears must have equal shapes.

    The kernels are stacked on a new leading axis (not concatenated), so a sharded output axis
    stays sharded as it is and the parameters keep their own names; on CPU one wide matmul
    beats two narrow ones (``bench/bench_transformer.py``).
    """
    first = linears[0]
    weights = [lin.weights(x.shape[x.ndim - first.n_in:]) for lin in linears]
    kernel = jnp.stack([k for k, _, _ in weights])  # [n, inputs..., features...]
    x = x.astype(kernel.dtype)
    y = jnp.tensordot(x, kernel, axes=(
        tuple(range(x.ndim - first.n_in, x.ndim)), tuple(range(1, first.n_in + 1))))
    # y: [batch..., n, features...]
    outs = [jnp.take(y, i, axis=x.ndim - first.n_in) for i in range(len(linears))]
    return [adapted(o if b is None else o + b, x, adapter, first.n_in)
            for o, (_, b, adapter) in zip(outs, weights, strict=True)]


class Embed(nn.Module):
    """A lookup table (rows, embed); ``attend`` gives logits against it (tied output head)."""

    num_embeddings: int
    features: int
    row_axis: str = ax.VOCAB
    dtype: str = "float32"
    param_dtype: str = "float32"
    init_std: float = 0.02

    def setup(self):
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(self.init_std), (self.row_axis, ax.EMBED)),
            (self.num_embeddings, self.features), dtype_of(self.param_dtype),
        )

    def __call__(self, ids):
        return jnp.take(self.embedding, ids, axis=0).astype(dtype_of(self.dtype))

    def attend(self, x):
        dt = dtype_of(self.dtype)
        return jnp.einsum("ble,ve->blv", x.astype(dt), self.embedding.astype(dt))


# ----------------------------------------------------------------------------------- rotary
# rope_scaling types rope_inv_freq computes, with the keys each needs.
ROPE_SCALING = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_inv_freq(config, local: bool = False) -> np.ndarray:
    """Inverse frequencies of the rotary embedding, float32, as Hugging Face computes them.

    Handles ``partial_rotary_factor`` and ``rope_scaling`` types default, linear and llama3
    (the latter exactly as ``transformers.modeling_rope_utils._compute_llama3_parameters``).
    A ``local`` layer with ``rope_local_base_freq`` set uses that base, unscaled (Gemma 3).
    """
    dim = int(config.head_size * config.partial_rotary_factor)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    local_base = config.rope_local_base_freq if local else None
    theta = local_base or config.rope_theta
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    scaling = {} if local_base else config.rope_scaling_dict
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if kind != "llama3":
        raise NotImplementedError(f"rope_scaling type {kind!r} (supported: {', '.join(ROPE_SCALING)})")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """Rotate the first ``2 * len(inv_freq)`` features of ``x`` (rotate-half, as HF Llama).

    x: [batch, length, heads, head_dim]; positions: [batch, length].
    """
    rot = 2 * inv_freq.shape[0]
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [batch, length, rot/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [batch, length, 1, rot]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = x_rot * cos + rotated * sin
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


# -------------------------------------------------------------------------------- attention
def attention_mask(q_slots, k_slots, q_segments, k_segments, sliding_window):
    """Boolean mask [batch, 1, q_len, k_len]: causal, same segment, within the window.

    Slots are each token's index in its row (cache slot when decoding); a query at i sees a
    key at j when j <= i, i - j < sliding_window, and their segment ids are equal.
    """
    i, j = q_slots[:, None, :, None], k_slots[:, None, None, :]
    mask = j <= i
    if sliding_window:
        mask &= i - j < sliding_window
    if q_segments is not None:
        mask &= q_segments[:, None, :, None] == k_segments[:, None, None, :]
    return mask


def _implementation(config, dtype):
    if config.attention_impl != "auto":
        return config.attention_impl
    on_gpu = jax.default_backend() == "gpu"
    fits = config.head_size % 8 == 0 and config.head_size <= 256  # cuDNN flash attention's limits
    return "cudnn" if on_gpu and fits and dtype in (jnp.bfloat16, jnp.float16) else "xla"


def softcap(x, cap):
    """``cap * tanh(x / cap)``: values squashed smoothly into (-cap, cap) (Gemma 2)."""
    return cap * jnp.tanh(x / cap)


def xla_attention(q, k, v, mask, scale, logit_cap=None):
    """Attention in plain XLA ops, for what ``jax.nn.dot_product_attention`` cannot take
    (soft-capped logits): scores scaled, capped, masked, softmax in float32 (as HF's eager).

    q: [batch, q_len, heads, head_dim]; k, v: [batch, k_len, kv_heads, head_dim];
    mask: bool [batch, 1, q_len, k_len]. Query heads are grouped over their kv head (GQA).
    """
    batch, length, heads, dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, length, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("blkgd,bmkd->bkglm", q, k) * jnp.asarray(scale, q.dtype)
    # [batch, kv_heads, group, q_len, k_len]
    if logit_cap:
        scores = softcap(scores, jnp.asarray(logit_cap, scores.dtype))
    scores = jnp.where(mask[:, :, None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    ctx = jnp.einsum("bkglm,bmkd->blkgd", probs, v)
    return ctx.reshape(batch, length, heads, dim)  # [batch, length, heads, head_dim]


class Attention(nn.Module):
    """Multi-head attention with MHA/GQA/MQA, rotary positions, windows, segments, a KV cache.

    ``local``: a layer of the config's local kind (its ``sliding_window`` and local rotary
    base); with a layer pattern (``sliding_window_pattern``) the global layers see everything.
    """

    config: object
    local: bool = True

    def _cached(self, name, shape, axes, dtype):
        return self.variable(
            "cache", name, nn.with_logical_partitioning(jnp.zeros, axes), shape, dtype
        )

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, decode: bool = False):
        cfg = self.config
        dt = dtype_of(cfg.dtype)
        nh, nkv, hd = cfg.num_attention_heads, cfg.kv_heads, cfg.head_size
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, init_std=cfg.initializer_range,
                  lora=linear_lora(cfg))
        q = Linear((nh, hd), (ax.EMBED, ax.HEADS, ax.HEAD_DIM), cfg.attention_bias, name="q", **kw)(x)
        kv = [Linear((nkv, hd), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), cfg.attention_bias, name=n, **kw)
              for n in ("k", "v")]
        k, v = fused(kv, x) if cfg.fuse_projections else (kv[0](x), kv[1](x))
        if cfg.qk_norm != "none":  # RMSNorm of each head ("head", Qwen3) or of all heads ("projection", OLMo 2)
            q_axes = (ax.HEAD_DIM,) if cfg.qk_norm == "head" else (ax.HEADS, ax.HEAD_DIM)
            k_axes = (ax.HEAD_DIM,) if cfg.qk_norm == "head" else (ax.KV_HEADS, ax.HEAD_DIM)
            norm = dict(eps=cfg.rms_norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                        plus_one=cfg.norm_type == "rmsnorm_plus_one")  # Gemma 3: (1 + w)
            q = RMSNorm(**norm, axes=q_axes, name="q_norm")(q)
            k = RMSNorm(**norm, axes=k_axes, name="k_norm")(k)
        if cfg.position_embedding == "rope":
            inv_freq = rope_inv_freq(cfg, self.local)
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        q = checkpoint_name(constrain(q, (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM)), "query")
        k = checkpoint_name(constrain(k, (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM)), "key")
        v = checkpoint_name(constrain(v, (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM)), "value")
        # [batch, length, heads|kv_heads, head_dim]

        batch, length = x.shape[:2]
        window = cfg.sliding_window if self.local else None
        scale = (cfg.query_pre_attn_scalar or hd) ** -0.5
        if decode:
            k, v, mask = self._update_cache(k, v, segment_ids, batch, length, window)
        elif cfg.attn_logit_softcapping:
            # causality by position (restarting per packed segment, which the segment mask
            # separates): right in any token order, also the ring's zig-zag one under cp
            mask = attention_mask(positions, positions, segment_ids, segment_ids, window)
        if cfg.attn_logit_softcapping:  # jax.nn.dot_product_attention cannot cap the logits
            ctx = xla_attention(q, k, v, mask, scale, cfg.attn_logit_softcapping)
        elif decode:
            ctx = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")
        elif (ring := ring_axes()) and not self.is_initializing():  # context parallelism
            ctx = ring_attention(q, k, v, segment_ids, ring, sliding_window=window, scale=scale,
                                 strategy=cfg.context_attention)
        else:
            mask = None
            if segment_ids is not None:
                mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
            ctx = jax.nn.dot_product_attention(
                q, k, v, mask=mask, scale=scale, is_causal=True,
                local_window_size=(window - 1, 0) if window else None,
                implementation=_implementation(cfg, dt),
            )
        ctx = checkpoint_name(ctx, "attn_context")  # [batch, length, heads, head_dim]
        out = Linear(
            (cfg.hidden_size,), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), cfg.attention_out_bias, name="o", **kw
        )(ctx)
        return checkpoint_name(out, "attn_out")  # [batch, length, embed]

    def _update_cache(self, k, v, segment_ids, batch, length, window):
        """Write this chunk's keys/values at the cache index; mask over the whole cache."""
        cache_axes = (ax.BATCH, ax.CACHE_LENGTH, ax.KV_HEADS, ax.HEAD_DIM)
        # The cache is created by an init call whose length is the cache length.
        ck = self._cached("cached_key", k.shape, cache_axes, k.dtype)
        cv = self._cached("cached_value", v.shape, cache_axes, v.dtype)
        cseg = self._cached("cached_segment_ids", (batch, length), (ax.BATCH, ax.CACHE_LENGTH), jnp.int32)
        index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
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
        mask = attention_mask(q_slots, k_slots, seg, cseg.value, window)
        return ck.value, cv.value, mask


# ------------------------------------------------------------------------------------- mlps
# HF activation names: silu, gelu (exact), gelu_new / gelu_pytorch_tanh (tanh), relu.
ACTIVATIONS = {
    "silu": jax.nn.silu, "swish": jax.nn.silu, "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def activation(name: str):
    """The function of an HF activation name (configs check the name when they are built)."""
    return ACTIVATIONS[name]


@jax.custom_vjp
def swiglu(gate, up):
    """``silu(gate) * up`` with a hand-written backward (one fused pass on CPU)."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, g):
    gate, up = res
    sig = jax.nn.sigmoid(gate)
    return g * up * sig * (1 + gate * (1 - sig)), g * gate * sig


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class MLP(nn.Module):
    """Gated (SwiGLU: down(act(gate x) * up x)) or plain (down(act(up x))) feed-forward."""

    config: object

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, init_std=cfg.initializer_range,
                  lora=linear_lora(cfg))
        act = activation(cfg.hidden_act)
        def linear(name):
            return Linear((cfg.intermediate_size,), (ax.EMBED, ax.MLP), cfg.mlp_bias, name=name, **kw)

        if cfg.mlp_type == "gated":
            up, gate = linear("up"), linear("gate")
            up, gate = fused([up, gate], x) if cfg.fuse_projections else (up(x), gate(x))
            h = swiglu(gate, up) if cfg.hidden_act in ("silu", "swish") else act(gate) * up
        else:
            h = act(linear("up")(x))
        h = checkpoint_name(constrain(h, (ax.BATCH, ax.LENGTH, ax.MLP)), "mlp_hidden")
        out = Linear((cfg.hidden_size,), (ax.MLP, ax.EMBED), cfg.mlp_bias, name="down", **kw)(h)
        return checkpoint_name(out, "mlp_out")  # [batch, length, embed]
