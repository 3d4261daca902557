"""A multilayer perceptron whose parameters and activations carry logical axis names.

Hidden kernels alternate their names so no array names one axis twice and every kernel has
both an ``embed`` and an ``mlp`` dimension (FSDP shards each along ``embed``, tensor
parallelism along ``mlp``): layer 0 is (embed, mlp), layer 1 (mlp, embed), layer 2
(embed, mlp), ... The input features are ``embed``; the head is (embed|mlp, vocab), where
``vocab`` means output classes (or regression targets).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn

from shardzoo.models import DTYPES, ModelError, check_fields, register
from shardzoo.models.config import ModelConfig
from shardzoo.models.costs import mlp_activations
from shardzoo.models.layers import constrain
from shardzoo.sharding import axes as ax

ACTIVATIONS = {"relu": nn.relu, "gelu": nn.gelu, "silu": nn.silu, "tanh": jnp.tanh}
TASKS = ("classification", "regression")


@dataclasses.dataclass(frozen=True)
class MLPArch:
    """An MLP: ``depth`` hidden layers of ``width`` features and a head of ``num_outputs``."""

    in_features: int = 16
    depth: int = 2
    width: int = 32
    num_outputs: int = 4  # classes (classification) or targets (regression)
    activation: str = "relu"
    dropout_rate: float = 0.0
    task: str = "classification"

    def __post_init__(self):
        check_fields(self, {"task": TASKS, "activation": tuple(ACTIVATIONS)},
                     ("in_features", "depth", "width", "num_outputs"))
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ModelError(f"MLPArch.dropout_rate={self.dropout_rate} must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class MLPExecution:
    """How an MLP runs: its compute and parameter dtypes."""

    dtype: str = "float32"  # compute
    param_dtype: str = "float32"

    def __post_init__(self):
        check_fields(self, {"dtype": DTYPES, "param_dtype": DTYPES})


class MLPConfig(ModelConfig):
    """An MLP's ``arch`` (``MLPArch``) and ``execution`` (``MLPExecution``)."""

    ARCH: ClassVar[type] = MLPArch
    EXECUTION: ClassVar[type] = MLPExecution

    def __init__(self, arch: MLPArch | None = None, execution: MLPExecution | None = None):
        super().__init__(arch or MLPArch(), execution or MLPExecution())

    @property
    def task(self) -> str:
        return self.arch.task

    def build(self, placement=None) -> MLP:
        return MLP(self, placement)

    def sample_inputs(self, batch_size: int, seq_len: int | None = None):
        """What ``init`` is called on: features [batch, embed]; ``seq_len`` is unused."""
        return (jax.ShapeDtypeStruct((batch_size, self.arch.in_features), jnp.float32),)

    def _widths(self) -> list[int]:
        a = self.arch
        return [a.in_features] + [a.width] * a.depth + [a.num_outputs]

    def num_params(self, active: bool = False) -> int:
        """Parameters: every hidden layer's kernel and bias, and the head's."""
        w = self._widths()
        return sum(a * b + b for a, b in zip(w[:-1], w[1:], strict=True))

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per example: 6 x the kernels' parameters (forward 2, backward 4)."""
        w = self._widths()
        return 6.0 * sum(a * b for a, b in zip(w[:-1], w[1:], strict=True))

    def activation_estimate(self, batch_size: int, seq_len, shards):
        """Activation bytes a train step keeps per device (``models/costs.py``)."""
        return mlp_activations(self, batch_size, shards)

    def pipeline_plan(self, batch_size: int, shards):
        return None

    @property
    def max_positions(self) -> None:
        return None

    @property
    def trains(self):
        return None

    @property
    def remat_policies(self) -> tuple[str, ...]:
        return ()


def layer_axes(i: int) -> tuple[str, str]:
    """Logical (in, out) names of hidden layer ``i``'s kernel."""
    return (ax.EMBED, ax.MLP) if i % 2 == 0 else (ax.MLP, ax.EMBED)


class MLP(nn.Module):
    config: MLPConfig
    placement: object = None  # sharding.partition.Placement (None: one device)

    @nn.compact
    def __call__(self, x, *, deterministic: bool = True):
        """Features [batch, embed] to logits (or predictions) [batch, vocab]."""
        cfg, placement = self.config.arch, self.placement
        dtype, param_dtype = jnp.dtype(self.config.execution.dtype), jnp.dtype(self.config.execution.param_dtype)
        act = ACTIVATIONS[cfg.activation]
        x = constrain(x.astype(dtype), (ax.BATCH, ax.EMBED), placement)
        out_axis = ax.EMBED
        for i in range(cfg.depth):
            in_axis, out_axis = layer_axes(i)
            x = nn.Dense(
                cfg.width,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.lecun_normal(), (in_axis, out_axis)
                ),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (out_axis,)),
                name=f"layers_{i}",
            )(x)
            x = nn.Dropout(cfg.dropout_rate)(act(x), deterministic=deterministic)
            x = constrain(x, (ax.BATCH, out_axis), placement)  # [batch, embed|mlp]
        logits = nn.Dense(
            cfg.num_outputs,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), (out_axis, ax.VOCAB)
            ),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (ax.VOCAB,)),
            name="head",
        )(x)
        return constrain(logits, (ax.BATCH, ax.VOCAB), placement)  # [batch, vocab]


register("mlp-tiny", MLPConfig())
register("mlp-tiny-regression", MLPConfig(MLPArch(task="regression", num_outputs=1)))
register("mlp-mnist", MLPConfig(MLPArch(in_features=784, depth=2, width=512, num_outputs=10)))
