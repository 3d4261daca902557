"""The norms of the zoo, each kind one line of ``NORMS``: its module, its weight's init and its
parameters (each named by the norm's logical ``axes``).

``arch.norm_type`` names a kind; ``make_norm`` builds it, ``models/costs.py`` and the attention's
qk-norm count its parameters, ``models/features.py`` names its feature, all from the table. A new
norm kind is one line below (and its feature's description in ``models/features.py``).
Every kind computes in float32 and keeps the checkpoints' parameter names (``scale``, ``bias``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn

from shardzoo.models import ModelError
from shardzoo.models.component import SubRecord
from shardzoo.models.layers import dtype_of, positive
from shardzoo.sharding import axes as ax


def _scale(module, x, dtype32):
    """The weight of a norm (``plus_one``: scale by 1 + w, w zero-initialized), or None."""
    if not module.use_scale:
        return None
    init = nn.initializers.zeros if module.plus_one else nn.initializers.ones
    w = module.param("scale", nn.with_logical_partitioning(init, module.axes), x.shape[x.ndim - len(module.axes):],
                     dtype_of(module.param_dtype)).astype(dtype32)
    return 1.0 + w if module.plus_one else w


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama), computed in float32 like Hugging Face's.

    Its weight is named ``axes`` (the last ``len(axes)`` dimensions of ``x``); it normalizes
    over the last ``dims`` of them (all when None): the model width, one head's features
    (Qwen3's qk-norm; Cohere's, with a weight per head) or all heads' (OLMo 2's).
    """

    eps: float = 1e-6
    dtype: str = "float32"
    param_dtype: str = "float32"
    axes: tuple[str, ...] = (ax.EMBED,)
    plus_one: bool = False  # scale by (1 + weight), weight zero-initialized (Gemma)
    dims: int | None = None
    use_scale: bool = True

    @nn.compact
    def __call__(self, x):
        dims = tuple(range(x.ndim - (self.dims or len(self.axes)), x.ndim))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=dims, keepdims=True) + self.eps)
        scale = _scale(self, x, jnp.float32)
        return (y if scale is None else y * scale).astype(dtype_of(self.dtype))


class LayerNorm(nn.Module):
    """Layer norm in float32 with scale (``use_scale``; ``plus_one``: 1 + weight, Nemotron's
    LayerNorm1P) and bias (``use_bias``); neither: OLMo 1's weightless norm. ``axes`` and ``dims``
    as ``RMSNorm``'s."""

    eps: float = 1e-5
    dtype: str = "float32"
    param_dtype: str = "float32"
    use_bias: bool = True
    axes: tuple[str, ...] = (ax.EMBED,)
    dims: int | None = None
    plus_one: bool = False
    use_scale: bool = True

    @nn.compact
    def __call__(self, x):
        dims = tuple(range(x.ndim - (self.dims or len(self.axes)), x.ndim))
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=dims, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=dims, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        scale = _scale(self, x, jnp.float32)
        y = y if scale is None else y * scale
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.axes),
                              x.shape[x.ndim - len(self.axes):], dtype_of(self.param_dtype))
            y = y + bias.astype(jnp.float32)
        return y.astype(dtype_of(self.dtype))


@dataclasses.dataclass(frozen=True)
class Norm:
    """A norm kind: its module and the settings it is built with; ``params``: the parameters it
    has (each of the norm's logical axes; ``scale`` ones-initialized, or zeros with
    ``plus_one``; ``bias`` zeros)."""

    name: str
    module: type
    settings: dict = dataclasses.field(default_factory=dict)

    @property
    def params(self) -> tuple[str, ...]:
        s = self.settings
        return (("scale",) if s.get("use_scale", True) else ()) + (
            ("bias",) if self.module is LayerNorm and s.get("use_bias", True) else ())


NORMS = {n.name: n for n in (
    Norm("rmsnorm", RMSNorm),
    Norm("rmsnorm_plus_one", RMSNorm, dict(plus_one=True)),  # Gemma
    Norm("rmsnorm_no_weight", RMSNorm, dict(use_scale=False)),  # nanochat
    Norm("layernorm", LayerNorm),
    Norm("layernorm_no_bias", LayerNorm, dict(use_bias=False)),  # Cohere
    Norm("layernorm_plus_one", LayerNorm, dict(plus_one=True)),  # Nemotron's LayerNorm1P
    Norm("layernorm_no_weight", LayerNorm, dict(use_scale=False, use_bias=False)),  # OLMo 1
)}


def norm_params(a, width: int, bias: bool = True) -> int:
    """Parameters of one norm of ``a.norm_type`` over ``width`` features (``bias=False``: its
    bias dropped, as ``make_norm``'s)."""
    names = NORMS[a.norm_type].params
    return width * sum(1 for n in names if bias or n != "bias")


def make_norm(config, name: str, axes: tuple[str, ...] = (ax.EMBED,), dims: int | None = None,
              bias: bool = True, eps: float | None = None) -> nn.Module:
    """The architecture's norm (``norm_type``, a kind of ``NORMS``) as a named submodule, its
    weight named ``axes``, normalizing over the last ``dims`` of them (all when None);
    ``bias=False``: the kind without its bias (StableLM's qk-norm); ``eps`` None: ``rms_norm_eps``."""
    a, e = config.arch, config.execution
    kind = NORMS[a.norm_type]
    settings = dict(kind.settings)
    if kind.module is LayerNorm and not bias:
        settings["use_bias"] = False
    return kind.module(eps=a.rms_norm_eps if eps is None else eps, dtype=e.dtype, param_dtype=e.param_dtype, axes=axes, dims=dims,
                       name=name, **settings)


@dataclasses.dataclass(frozen=True)
class LayerNorms(SubRecord):
    """The epsilon of the layers' own norms (before and after their mixer and MLP) where it is
    not ``rms_norm_eps``, which the final norm keeps (JetMoE: transformers builds its layers'
    RMSNorms with the default 1e-6 whatever rms_norm_eps says)."""

    NAME: ClassVar[str] = "layer_norms"
    FEATURE: ClassVar[str] = "layer_norm_eps"
    FLAT: ClassVar[dict[str, str]] = {"layer_norm_eps": "eps"}

    eps: float | None = None

    def used(self, arch) -> bool:
        return self.eps is not None and self.eps != arch.rms_norm_eps

    def check(self, arch) -> None:
        if not positive(self.eps):
            raise ModelError(f"layer_norm_eps={self.eps!r} must be a finite number > 0 (or null: rms_norm_eps)")


def block_norm(config, name: str) -> nn.Module:
    """A norm of a layer's block (``models/blocks.py``): ``make_norm`` with the layers' epsilon (``layer_norms``)."""
    own = config.arch.layer_norms
    return make_norm(config, name, eps=None if own is None else own.eps)
