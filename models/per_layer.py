"""Gemma 3n's layer mechanisms, the ``per_layer`` sub-record of the architecture and the layers
that read it.

- per-layer input embeddings: a table of ``hidden_size_per_layer_input`` features per layer and
  token (``embed_tokens_per_layer``), plus a projection of the embeddings (normed per layer),
  their sum / sqrt 2 handed to each layer, which gates it by its own output and adds it back;
- KV sharing: the last ``num_kv_shared_layers`` layers attend the keys and values of the last
  earlier layer of their attention kind (no k, v projections nor cache of their own);
- AltUp (``altup_num_inputs`` > 1): parallel residual streams, the first made of the embeddings,
  the others projections of them at its magnitude; each layer predicts every stream from all
  (coefficients routed per token), runs the active one, corrects the rest by its innovation;
  the streams projected back and averaged before the final norm;
- Laurel (``laurel_rank``): a low-rank residual branch beside attention;
- activation sparsity (``activation_sparsity_pattern``): per layer, the MLP's gate through
  ``gaussian_top_k``.
Gemma 4's small models (E2B, E4B) have the first two alone, their per-layer input added to the
one residual stream before the layer's scalar.

Layers that pass keys and values from one to another, and streams that are not one [batch,
length, embed] carry, do not fit the scanned stack: a model with this record builds its layers
unrolled (``TransformerConfig.layout``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn

from shardzoo.models import ModelError
from shardzoo.models.attention import Attention, layer_arch
from shardzoo.models.component import SubRecord
from shardzoo.models.features import feature
from shardzoo.models.layers import MLP, Embed, Linear, activation, constrain, linear_kw, mlp_params
from shardzoo.models.norms import make_norm
from shardzoo.sharding import axes as ax

BLE = (ax.BATCH, ax.LENGTH, ax.EMBED)
# the streams' stack, constrained where it is made: left to XLA's propagation (CPU, data=2, fsdp=2,
# tensor=2 under fsdp_tp) two of four batch rows came out wrong
SBLE = (ax.STREAMS, ax.BATCH, ax.LENGTH, ax.EMBED)


def _tuple(value):
    return tuple(value) if isinstance(value, list) else value


@dataclasses.dataclass(frozen=True)
class PerLayerArch(SubRecord):
    """Gemma 3n's settings (defaults: none of its mechanisms)."""

    NAME: ClassVar[str] = "per_layer"
    FEATURE: ClassVar[str] = "gemma3n_layers"
    FLAT: ClassVar[dict[str, str]] = {
        "hidden_size_per_layer_input": "input_size", "vocab_size_per_layer_input": "vocab_size",
        "num_kv_shared_layers": "kv_shared_layers", "altup_num_inputs": "altup_inputs",
        "altup_active_idx": "altup_active", "altup_coef_clip": "altup_coef_clip",
        "altup_correct_scale": "altup_correct_scale", "laurel_rank": "laurel_rank",
        "activation_sparsity_pattern": "activation_sparsity", "use_double_wide_mlp": "double_wide_mlp"}

    input_size: int = feature(0, lambda v: "per_layer_inputs" if v else None)
    vocab_size: int | None = None  # the per-layer table's rows (None: vocab_size)
    kv_shared_layers: int = feature(0, lambda v: "kv_sharing" if v else None)
    altup_inputs: int = feature(1, lambda v: "altup" if v > 1 else None)
    altup_active: int = 0
    altup_coef_clip: float | None = None  # training clips the coefficients' weights to +- it
    altup_correct_scale: bool = False  # the active stream's correction times a learned scale
    laurel_rank: int = feature(0, lambda v: "laurel" if v else None)
    activation_sparsity: tuple[float, ...] | None = feature(None, lambda v: "activation_sparsity" if v else None)
    double_wide_mlp: bool = feature(False, "kv_sharing")  # the KV-sharing layers' MLPs twice as wide (Gemma 4)

    def __post_init__(self):
        object.__setattr__(self, "activation_sparsity", _tuple(self.activation_sparsity))
        if self.activation_sparsity is not None and not any(self.activation_sparsity):
            object.__setattr__(self, "activation_sparsity", None)
        if not self.kv_shared_layers:
            object.__setattr__(self, "double_wide_mlp", False)  # no layer to widen
        if self.altup_inputs == 1:  # nothing to predict, correct or scale
            for name, value in (("altup_active", 0), ("altup_coef_clip", None), ("altup_correct_scale", False)):
                object.__setattr__(self, name, value)

    def check(self, arch) -> None:
        n = arch.num_hidden_layers
        if not self.altup_inputs >= 1 or not 0 <= self.altup_active < self.altup_inputs:
            raise ModelError(f"altup_num_inputs={self.altup_inputs} must be >= 1 and altup_active_idx="
                             f"{self.altup_active} one of its streams")
        if self.altup_inputs > 1 and self.altup_active != 0:
            raise ModelError(f"altup_active_idx={self.altup_active}: shardzoo runs stream 0 (Gemma 3n's)")
        if self.altup_inputs > 1 and not self.input_size:
            raise ModelError("AltUp (altup_num_inputs > 1) needs per-layer inputs (hidden_size_per_layer_input)")
        if self.activation_sparsity is not None and len(self.activation_sparsity) != n:
            raise ModelError(f"activation_sparsity_pattern has {len(self.activation_sparsity)} values for "
                             f"num_hidden_layers={n}")
        if not 0 <= self.kv_shared_layers < n:
            raise ModelError(f"num_kv_shared_layers={self.kv_shared_layers} must be below num_hidden_layers={n}")
        sources = kv_sources(arch, self)
        if None in sources[n - self.kv_shared_layers:]:
            raise ModelError(f"num_kv_shared_layers={self.kv_shared_layers}: a shared layer's attention kind has no "
                             "earlier layer to take keys and values from (layer_types)")
        if arch.block_form != "sequential" or arch.norm_position != "both" or arch.moe:
            raise ModelError("the layers of per_layer (Gemma 3n's, Gemma 4's with per-layer inputs or KV sharing) "
                             "have four norms (norm_position='both'), a dense MLP (no MoE), the sequential block form")
        if arch.layer_scalar and self.altup_inputs > 1:
            raise ModelError("layer_scalar (Gemma 4's) scales one residual stream; altup_num_inputs must be 1")


def kv_sources(a, p: PerLayerArch) -> tuple[int | None, ...]:
    """Per layer: the earlier layer whose keys and values it attends (the last before the shared
    ones with its attention kind), or None where it has its own."""
    n = a.num_hidden_layers
    types = a.layer_types or (a.default_layer_type,) * n
    first = n - p.kv_shared_layers
    last = {t: i for i, t in enumerate(types[:first])}
    return tuple(last.get(types[i]) if i >= first else None for i in range(n))


# ---------------------------------------------------------------------------------- pieces
def _rms(x):
    return jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True))


def _at_magnitude(h, target):
    """``h`` rescaled to the root mean square ``target`` (AltUp's streams)."""
    return h * target / jnp.sqrt(jnp.maximum(jnp.mean(jnp.square(h), axis=-1, keepdims=True), 1e-5))


def _clipped(kernel, clip, deterministic):
    return kernel if deterministic or clip is None else jnp.clip(kernel, -clip, clip)


class AltUp(nn.Module):
    """AltUp's router and coefficients: ``predict`` [streams, batch, length, embed] from all of
    them, ``correct`` the predictions by the active stream's innovation."""

    config: object
    deterministic: bool = True

    def _coefs(self, x, name, width):
        """tanh(router(norm(x) / hidden_size)) through the ``name`` coefficients: [batch, length, width]."""
        a, kw = self.config.arch, linear_kw(self.config)
        p = a.per_layer
        routed = Linear((p.altup_inputs,), (ax.EMBED, ax.STREAMS), name="router", **kw)(
            make_norm(self.config, "router_norm")(x) * jnp.asarray(1.0 / a.hidden_size, x.dtype))
        modalities = jnp.tanh(routed.astype(jnp.float32)).astype(x.dtype)  # [batch, length, streams]
        kernel, _, _ = Linear((width,), (ax.STREAMS, ax.STREAM_COEFS), name=name, **kw).weights((p.altup_inputs,))
        return modalities @ _clipped(kernel, p.altup_coef_clip, self.deterministic).astype(x.dtype)

    def predict(self, xs):
        n = self.config.arch.per_layer.altup_inputs
        coefs = self._coefs(xs[0], "prediction", n * n).reshape(*xs.shape[1:3], n, n)  # [b, l, out, in]
        return xs + jnp.einsum("blji,ibld->jbld", coefs, xs)

    def correct(self, predictions, activated):
        coefs = self._coefs(activated, "correction", self.config.arch.per_layer.altup_inputs) + 1.0  # [b, l, n]
        innovation = activated - predictions[0]
        return predictions + jnp.moveaxis(coefs, -1, 0)[..., None] * innovation

    @nn.compact
    def __call__(self, xs, activated=None):
        """predict(xs), or with ``activated`` correct(xs, activated) (one module, two steps)."""
        return self.predict(xs) if activated is None else self.correct(xs, activated)


class Laurel(nn.Module):
    """x + norm(x @ left @ right): a low-rank residual branch (Gemma 3n's Laurel block)."""

    config: object

    @nn.compact
    def __call__(self, x):
        a, kw = self.config.arch, linear_kw(self.config)
        h = Linear((a.per_layer.laurel_rank,), (ax.EMBED, ax.PER_LAYER), name="left", **kw)(x)
        h = Linear((a.hidden_size,), (ax.PER_LAYER, ax.EMBED), name="right", **kw)(h)
        return x + make_norm(self.config, "norm")(h)


class PerLayerInput(nn.Module):
    """act(x @ gate) * the layer's input, projected back and normed: what a layer adds."""

    config: object

    @nn.compact
    def __call__(self, x, per_layer_input):
        a, kw = self.config.arch, linear_kw(self.config)
        h = Linear((a.per_layer.input_size,), (ax.EMBED, ax.PER_LAYER), name="gate", **kw)(x)
        h = activation(a.hidden_act)(h) * per_layer_input
        h = Linear((a.hidden_size,), (ax.PER_LAYER, ax.EMBED), name="projection", **kw)(h)
        return make_norm(self.config, "norm")(h)


def per_layer_inputs(config, x, inputs):
    """Each layer's input [batch, length, layers, per_layer]: (its row of the per-layer table,
    ids outside it reading row 0, + the normed projection of the embeddings ``x``) / sqrt 2."""
    a, e = config.arch, config.execution
    p, n = a.per_layer, a.num_hidden_layers
    rows = p.vocab_size or a.vocab_size
    kw = dict(dtype=e.dtype, param_dtype=e.param_dtype, init_std=a.initializer_range)
    table = Embed(rows, n * p.input_size, name="per_layer_embed", **kw)
    ids = jnp.where((inputs >= 0) & (inputs < rows), inputs, 0)
    own = table(ids) * jnp.asarray(p.input_size**0.5, x.dtype)
    proj = Linear((n * p.input_size,), (ax.EMBED, ax.PER_LAYER), name="per_layer_projection", **linear_kw(config))(x)
    proj = (proj * jnp.asarray(a.hidden_size**-0.5, x.dtype)).reshape(*x.shape[:2], n, p.input_size)
    proj = make_norm(config, "per_layer_projection_norm", (ax.PER_LAYER,))(proj)
    return (proj + own.reshape(proj.shape)) * jnp.asarray(2**-0.5, x.dtype)


# ---------------------------------------------------------------------------------- the layer
class PerLayerBlock(nn.Module):
    """One Gemma 3n layer over the streams [streams, batch, length, embed]: AltUp's prediction,
    attention (its own keys and values, or shared ones) and Laurel side by side, the MLP, the
    correction, and the per-layer input added to the other streams. Returns (streams, the keys
    and values it attended)."""

    config: object
    spec: object
    index: int
    placement: object = None
    deterministic: bool = True
    decode: bool = False

    @nn.compact
    def __call__(self, xs, per_layer_input, positions, segment_ids, shared_kv=None):
        cfg, a = self.config, self.config.arch
        p = a.per_layer
        altup = AltUp(cfg, self.deterministic, name="altup") if p.altup_inputs > 1 else None
        predictions = constrain(altup(xs), SBLE, self.placement) if altup else xs
        x = predictions[0]  # the active stream
        h = make_norm(cfg, "attn_norm")(x)
        attn, kv = Attention(cfg, self.spec, self.placement, returns_kv=True, name="attn")(
            h, positions, segment_ids, self.decode, shared_kv)
        x = x + make_norm(cfg, "post_attn_norm")(attn)
        if p.laurel_rank:
            x = (x + Laurel(cfg, name="laurel")(h)) * jnp.asarray(2**-0.5, x.dtype)
        x = constrain(x, BLE, self.placement)
        sparsity = p.activation_sparsity[self.index] if p.activation_sparsity else 0.0
        width = 2 * a.intermediate_size if p.double_wide_mlp and self.spec.shares_kv else None
        mlp = MLP(cfg, self.placement, width, sparsity, name="mlp")(make_norm(cfg, "mlp_norm")(x))
        x = constrain(x + make_norm(cfg, "post_mlp_norm")(mlp), BLE, self.placement)
        if altup is None:
            out = x[None]
            first = x
        else:
            out = altup(predictions, x)
            first = out[0]
            scale = self.param("altup_scale", nn.with_logical_partitioning(nn.initializers.zeros, (ax.EMBED,)),
                               (a.hidden_size,), jnp.dtype(cfg.execution.param_dtype))  # HF has it either way
            if p.altup_correct_scale:
                first = first * scale.astype(first.dtype)
        if p.input_size:
            added = PerLayerInput(cfg, name="per_layer_input")(first, per_layer_input)
            out = out.at[1:].add(added) if p.altup_inputs > 1 else out + added
        if a.layer_scalar:  # Gemma 4: the layer's output times its scalar (blocks imports this module)
            from shardzoo.models.blocks import LayerScalar

            out = LayerScalar(cfg.execution.param_dtype, name="layer_scalar")(out)
        return constrain(out, SBLE, self.placement), kv


def run_layers(model, x, inputs, positions, segment_ids, specs, block_class, deterministic, decode):
    """The layers of a model with the ``per_layer`` record, unrolled (``layers_i``), from the
    embeddings ``x`` to the hidden states the final norm reads. ``model``: the Transformer whose
    parameters these are (the per-layer table, AltUp's projections at its top level)."""
    cfg, placement = model.config, model.placement
    a = cfg.arch
    p = a.per_layer
    kw = linear_kw(cfg)
    layer_inputs = per_layer_inputs(cfg, x, inputs) if p.input_size else None
    target = _rms(x)
    streams = [x] + [_at_magnitude(Linear((a.hidden_size,), (ax.EMBED, ax.MLP), name=f"altup_in_{j}", **kw)(x),
                                   target) for j in range(1, p.altup_inputs)]
    xs = constrain(jnp.stack(streams), SBLE, placement)  # [streams, batch, length, embed]
    sources, kvs = kv_sources(a, p), {}
    block = block_class(PerLayerBlock)
    for i, spec in enumerate(specs):
        shared = kvs[sources[i]] if sources[i] is not None else None
        pl = layer_inputs[:, :, i] if layer_inputs is not None else None
        xs, kvs[i] = block(cfg, spec, i, placement, deterministic, decode, name=f"layers_{i}")(
            xs, pl, positions, segment_ids, shared)
    if p.altup_inputs == 1:
        return xs[0]
    target = _rms(xs[0])
    outs = [xs[0]] + [_at_magnitude(Linear((a.hidden_size,), (ax.EMBED, ax.MLP), name=f"altup_out_{j}", **kw)(
        xs[j]), target) for j in range(1, p.altup_inputs)]
    return constrain(jnp.mean(jnp.stack(outs), axis=0), BLE, placement)


# ---------------------------------------------------------------------------------- counts
def params(a) -> int:
    """The parameters the record adds to a model of ``a``'s layers (and takes: the shared layers'
    k and v projections and k-norms)."""
    p, d, n = a.per_layer, a.hidden_size, a.num_hidden_layers
    total = 0
    if p.input_size:
        total += (p.vocab_size or a.vocab_size) * n * p.input_size + d * n * p.input_size + p.input_size
        total += n * (2 * d * p.input_size + d)  # each layer's gate, projection and norm
    if p.altup_inputs > 1:
        k = p.altup_inputs
        total += 2 * (k - 1) * d * d  # the streams' projections in and out
        total += n * (d * k + d + k * k * k + k * k + d)  # router, its norm, coefficients, the output scale
    total += n * (2 * d * p.laurel_rank + d) if p.laurel_rank else 0
    for spec in a.layer_specs():
        if spec.shares_kv:
            la = layer_arch(a, spec)  # (Gemma 4's full layers: their own heads)
            kv = la.kv_heads * la.head_size
            total -= (2 - la.attention_k_eq_v) * (d * kv + kv * la.attention_bias) + la.head_size * (la.qk_norm == "head")
            total += mlp_params(a, a.intermediate_size)[0] if p.double_wide_mlp else 0  # its second width
    return total


def gaussian_top_k(x, sparsity: float):
    """relu(x - cutoff), the cutoff each row's mean + std x the standard normal's ``sparsity``
    quantile: about that share of features zeroed, taking them as normally distributed
    (Gemma 3n's activation sparsity, without a sort)."""
    multiplier = jax.scipy.special.ndtri(jnp.float32(sparsity)).astype(x.dtype)
    mean, std = jnp.mean(x, axis=-1, keepdims=True), jnp.std(x, axis=-1, keepdims=True)
    return jax.nn.relu(x - (mean + std * multiplier))

