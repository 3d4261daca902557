"""Pieces the model families share: the activation constraint, linears, embeddings, MLPs.

Modules take the model's config (``TransformerConfig``: ``config.arch`` what it is,
``config.execution`` how it runs) and, where they constrain activations, its ``placement``
(``sharding.partition.Placement``, None on one device). Every parameter names every dimension
with the logical vocabulary of ``sharding.axes``; the modules never name a mesh axis.
Attention is in ``models/attention.py``, the norms in ``models/norms.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from shardzoo.models import ModelError
from shardzoo.models.component import Mlp, SubRecord
from shardzoo.models.lora import linear_lora, target_of
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


def constrain(x, axes, placement):
    """Constrain an activation's sharding by logical names under ``placement`` (None: a no-op).

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
        if not apply or len(set(named)) < len(named):  # a name twice: reported, not applied
            return x
    return x if placement is None else placement.constrain(x, axes)


def linear_kw(config) -> dict:
    """What every projection of a Transformer takes from its config."""
    e = config.execution
    return dict(dtype=e.dtype, param_dtype=e.param_dtype, init_std=config.arch.initializer_range,
                lora=linear_lora(e), bitlinear=config.arch.bitlinear)


def weight_quant(w):
    """BitLinear's weights (BitNet b1.58): ternary times their mean |w| (absmean), in float32;
    the gradient passes straight through."""
    w32 = w.astype(jnp.float32)
    scale = 1.0 / jnp.maximum(jnp.mean(jnp.abs(w32)), 1e-5)
    q = jnp.clip(jnp.round(w32 * scale), -1, 1) / scale
    return w + jax.lax.stop_gradient(q.astype(w.dtype) - w)


def act_quant(x, n_in: int = 1):
    """BitLinear's inputs: 8-bit per token, scaled by their largest |x| over the last ``n_in``
    dims (absmax), in float32; the gradient passes straight through."""
    x32 = x.astype(jnp.float32)
    dims = tuple(range(x.ndim - n_in, x.ndim))
    scale = 127.0 / jnp.maximum(jnp.max(jnp.abs(x32), axis=dims, keepdims=True), 1e-5)
    q = jnp.clip(jnp.round(x32 * scale), -128, 127) / scale
    return x + jax.lax.stop_gradient(q.astype(x.dtype) - x)


# ------------------------------------------------------------------------------- linear, embed
def flat_tokens() -> bool:
    """Whether ``project`` runs its matmul over the leading dims flattened into one ([batch x
    length, inputs]): on a CPU with one device, the one place this is chosen. jax's backward of a
    matmul contracting several leading dims transposes the output's gradient into a copy
    ([outputs, batch, length]) before the weight gradient, which XLA:CPU keeps; over one
    flattened dim the weight gradient is a plain matmul of the two as they lie (BENCHMARKS.md,
    the CPU section). Elsewhere the leading dims stay apart, each keeping its own sharding."""
    return jax.default_backend() == "cpu" and jax.sharding.get_abstract_mesh().size <= 1


def project(x, kernel, n_in: int = 1):
    """``jnp.tensordot(x, kernel, n_in)``: ``x``'s last ``n_in`` dims against ``kernel``'s first;
    a 2-D matmul of the flattened dims where ``flat_tokens``."""
    lead, inner = x.shape[:x.ndim - n_in], kernel.shape[n_in:]
    if len(lead) < 2 or not flat_tokens():
        return jnp.tensordot(x, kernel, axes=n_in)
    y = jnp.dot(x.reshape(math.prod(lead), -1), kernel.reshape(math.prod(kernel.shape[:n_in]), -1))
    return y.reshape(*lead, *inner)


def padded(init, real: int, axis: int):
    """``init`` drawn with ``real`` entries along ``axis`` (0: all), then zero-padded to the
    whole shape: a padded vocabulary starts from the numbers the unpadded model draws."""
    def draw(key, shape, dtype=jnp.float32):
        if not real or real == shape[axis]:
            return init(key, shape, dtype)
        x = init(key, tuple(real if k == axis else n for k, n in enumerate(shape)), dtype)
        return jnp.pad(x, [(0, shape[k] - x.shape[k]) for k in range(len(shape))])
    return draw


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
    real_out: int = 0  # the last output dim's real size, the rest padding (0: none; the vocab's)
    bitlinear: bool = False  # BitNet b1.58's BitLinear: ternary weights, 8-bit inputs (weight_quant, act_quant)

    @property
    def n_in(self) -> int:
        return len(self.axes) - len(self.features)

    @nn.compact
    def weights(self, in_shape: tuple[int, ...]):
        """(kernel, bias or None, adapter or None) in the compute dtype; ``in_shape`` is the
        contracted dims; the adapter is ``(A, B, scale)``."""
        pdt, dt = dtype_of(self.param_dtype), dtype_of(self.dtype)
        shape = tuple(in_shape) + tuple(self.features)
        kernel = self._stored_flat(len(in_shape))
        if kernel is None:
            init = padded(nn.initializers.normal(stddev=self.init_std), self.real_out, len(shape) - 1)
            kernel = self.param("kernel", nn.with_logical_partitioning(init, self.axes), shape, pdt)
        bias = None
        if self.use_bias:
            bias = self.param(
                "bias", nn.with_logical_partitioning(nn.initializers.zeros, self.axes[self.n_in:]),
                tuple(self.features), pdt,
            ).astype(dt)
        adapter = None
        if self.lora and target_of(self.name) in self.lora[2]:  # float32 adapters, whatever the base's dtype
            rank, scale, _ = self.lora
            bound = 1.0 / math.sqrt(math.prod(in_shape))  # PEFT: kaiming_uniform(a=sqrt(5))
            a_init = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
            a = self.param("lora_a", nn.with_logical_partitioning(a_init, self.axes[:self.n_in] + (ax.LORA_RANK,)),
                           tuple(in_shape) + (rank,), jnp.float32)
            b = self.param("lora_b", nn.with_logical_partitioning(nn.initializers.zeros, (ax.LORA_RANK,) + self.axes[self.n_in:]),
                           (rank,) + tuple(self.features), jnp.float32)
            adapter = (a.astype(dt), b.astype(dt), scale)
        return (weight_quant(kernel) if self.bitlinear else kernel).astype(dt), bias, adapter

    def _stored_flat(self, n_in: int):
        """The kernel as decoding may store one with several output dims: flat,
        ``[inputs..., prod(features)]`` (``models.decode.flat_head_kernels``: q, k and v onto
        heads of a head_dim a TPU pads), or None (the kernel as declared, or none yet)."""
        if len(self.features) < 2 or not self.has_variable("params", "kernel"):
            return None
        kernel = self.get_variable("params", "kernel")
        if isinstance(kernel, nn.meta.AxisMetadata):  # boxed with its axes (an init's own): as declared
            return None
        return kernel if kernel.ndim == n_in + 1 else None

    def __call__(self, x):
        kernel, bias, adapter = self.weights(x.shape[x.ndim - self.n_in:])
        x = x.astype(dtype_of(self.dtype))
        x = act_quant(x, self.n_in) if self.bitlinear else x
        y = project(x, kernel, self.n_in)
        if kernel.ndim != self.n_in + len(self.features):  # stored flat: the output's dims again
            y = y.reshape(y.shape[:-1] + tuple(self.features))
        y = y if bias is None else y + bias
        return adapted(y, x, adapter, self.n_in)


def adapted(y, x, adapter, n_in: int):
    """``y + scale * (x A) B``: LoRA's low-rank path, never forming ``W + A B``."""
    if adapter is None:
        return y
    a, b, scale = adapter
    h = jnp.tensordot(x, a, axes=n_in) * scale  # [batch..., lora_rank]
    return y + jnp.tensordot(h, b, axes=1)


def fuses(execution) -> bool:
    """Whether ``execution.fuse_projections`` runs k|v and up|gate as one matmul here: as it says,
    except on a TPU, where two matmuls beat one wide one and the split of its stacked output
    (llama3.2-1b's train step on a v5e chip, 2 x 2048, save_qkv_mlp: 308.7 ms fused, 296.1 apart,
    BENCHMARKS.md). The parameters are the same either way."""
    return execution.fuse_projections and jax.default_backend() != "tpu"


def fused(linears, x):
    """``[lin(x) for lin in linears]`` as one matmul; the linears must have equal shapes.

    The kernels are stacked on a new leading axis (not concatenated), so a sharded output axis
    stays sharded as it is and the parameters keep their own names; on CPU one wide matmul
    beats two narrow ones (``bench/bench_transformer.py``). A decoding step (one token per row:
    a length axis of 1) runs them apart: there the kernels' reads are the cost, and stacking
    them would copy every kernel once per step (``bench/bench_decode.py``).
    """
    first = linears[0]
    lead = x.shape[:x.ndim - first.n_in]  # [batch, length, ...] before the inputs
    if len(lead) >= 2 and lead[-1] == 1:
        return [lin(x) for lin in linears]
    weights = [lin.weights(x.shape[x.ndim - first.n_in:]) for lin in linears]
    kernels = [k for k, _, _ in weights]
    if any(k.ndim != first.n_in + len(first.features) for k in kernels):  # stored flat (decoding)
        return [lin(x) for lin in linears]
    x = x.astype(kernels[0].dtype)
    x = act_quant(x, first.n_in) if first.bitlinear else x
    if flat_tokens():  # [inputs..., n, features...]: one 2-D matmul, no transposed kernel
        y = project(x, jnp.stack(kernels, axis=first.n_in), first.n_in)
    else:
        y = jnp.tensordot(x, jnp.stack(kernels), axes=(  # [n, inputs..., features...]
            tuple(range(x.ndim - first.n_in, x.ndim)), tuple(range(1, first.n_in + 1))))
    # y: [batch..., n, features...]; split (not taken apart by index): the backward concatenates
    # the outputs' gradients in one pass, where a take's scatter-add padded each and summed them
    axis = x.ndim - first.n_in
    outs = [jnp.squeeze(o, axis) for o in jnp.split(y, len(linears), axis=axis)]
    return [adapted(o if b is None else o + b, x, adapter, first.n_in)
            for o, (_, b, adapter) in zip(outs, weights, strict=True)]


class Embed(nn.Module):
    """A lookup table (rows, embed); a tied output head reads ``embedding`` as its kernel."""

    num_embeddings: int
    features: int
    row_axis: str = ax.VOCAB
    dtype: str = "float32"
    param_dtype: str = "float32"
    init_std: float = 0.02
    real_rows: int = 0  # rows past it are padding (0: none; a padded vocabulary)

    def setup(self):
        init = padded(nn.initializers.normal(self.init_std), self.real_rows, 0)
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(init, (self.row_axis, ax.EMBED)),
            (self.num_embeddings, self.features), dtype_of(self.param_dtype),
        )

    def __call__(self, ids):
        return jnp.take(self.embedding, ids, axis=0).astype(dtype_of(self.dtype))


# ------------------------------------------------------------------------------------- mlps
# HF activation names: silu, gelu (exact), gelu_new / gelu_pytorch_tanh / gelu_fast (tanh), relu, relu2 (squared).
ACTIVATIONS = {
    "silu": jax.nn.silu, "swish": jax.nn.silu, "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),  # Arcee (Primer's squared ReLU)
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),  # GPT-NeoX-20B
}


def activation(name: str):
    """The function of an HF activation name (configs check the name when they are built;
    "xielu" has parameters: ``XIELU``)."""
    return ACTIVATIONS[name]


def _softplus_inverse(y: float) -> float:
    return math.log(math.expm1(y))


class XIELU(nn.Module):
    """xIELU (arXiv 2411.13010; Apertus), as transformers' ``XIELUActivation`` computes it::

        alpha_p' = softplus(alpha_p), alpha_n' = beta + softplus(alpha_n)
        x > 0:  alpha_p' x^2 + beta x
        else:   alpha_n' (expm1(min(x, eps)) - x) + beta x

    Four scalars per layer (a leading ``layers`` axis when scanned), stored as transformers
    stores them: ``alpha_p`` and ``alpha_n`` before their softplus (learned), ``beta`` and
    ``eps`` as read (buffers there: fixed, so no gradient reaches them here either). Computed
    in the activation's dtype, as transformers does.
    """

    param_dtype: str = "float32"
    alpha_p_init: float = 0.8
    alpha_n_init: float = 0.8
    beta_init: float = 0.5
    eps_init: float = -1e-6

    @nn.compact
    def __call__(self, x):
        def scalar(name, value):
            init = nn.initializers.constant(value)
            return self.param(name, nn.with_logical_partitioning(init, ()), (), dtype_of(self.param_dtype))

        alpha_p = scalar("alpha_p", _softplus_inverse(self.alpha_p_init))
        alpha_n = scalar("alpha_n", _softplus_inverse(self.alpha_n_init - self.beta_init))
        beta = jax.lax.stop_gradient(scalar("beta", self.beta_init)).astype(x.dtype)
        eps = jax.lax.stop_gradient(scalar("eps", self.eps_init)).astype(x.dtype)
        alpha_p = jax.nn.softplus(alpha_p.astype(x.dtype))
        alpha_n = beta + jax.nn.softplus(alpha_n.astype(x.dtype))
        positive = alpha_p * x * x + beta * x
        negative = (jnp.expm1(jnp.minimum(x, eps)) - x) * alpha_n + beta * x
        return jnp.where(x > 0, positive, negative)


def positive(value) -> bool:
    """A finite number > 0 (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclasses.dataclass(frozen=True)
class Multipliers(SubRecord):
    """Falcon-H1's muP multipliers (1: none): the attention's input and output, its keys (the k
    projection's output), the mamba mixer's input and output, its in_proj outputs z, x, B, C, dt
    (``ssm``), the MLP's gate projection and its output (``mlp``: gate, down)."""

    NAME: ClassVar[str] = "multipliers"
    FEATURE: ClassVar[str] = "mup_multipliers"
    FLAT: ClassVar[dict[str, str]] = {
        "key_multiplier": "key", "attention_in_multiplier": "attention_in", "attention_out_multiplier": "attention_out",
        "ssm_in_multiplier": "ssm_in", "ssm_out_multiplier": "ssm_out", "ssm_multipliers": "ssm",
        "mlp_multipliers": "mlp"}

    key: float = 1.0
    attention_in: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    ssm: tuple[float, ...] = (1.0,) * 5
    mlp: tuple[float, float] = (1.0, 1.0)

    def __post_init__(self):
        for flat, name in self.FLAT.items():
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, value := tuple(value))
            n = {"ssm": 5, "mlp": 2}.get(name)
            if n is None and not positive(value):
                raise ModelError(f"{flat}={value!r} must be a finite number > 0")
            if n is not None and (not isinstance(value, tuple) or len(value) != n or not all(map(positive, value))):
                raise ModelError(f"{flat}={value!r} must be {n} finite numbers > 0")

    def check(self, arch) -> None:
        if arch.mlp_type == "plain" and self.mlp[0] != 1.0:
            raise ModelError(f"mlp_multipliers={list(self.mlp)}: a plain MLP has no gate to scale")
        if arch.moe and self.mlp != (1.0, 1.0):
            raise ModelError(f"mlp_multipliers={list(self.mlp)} scale dense MLPs only; "
                             f"num_local_experts={arch.moe.num_local_experts}")


NO_MULTIPLIERS = Multipliers()


def scaled(x, multiplier: float):
    """``x`` times a model multiplier in its dtype (none when 1)."""
    return x if multiplier == 1.0 else x * jnp.asarray(multiplier, x.dtype)


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
    """Gated (SwiGLU: down(act(gate x) * up x)) or plain (down(act(up x))) feed-forward;
    ``multipliers.mlp`` (gate, down) scale the gate projection's output and the MLP's (Falcon-H1)."""

    config: object
    placement: object = None
    width: int | None = None  # None: intermediate_size (a MoE layer's shared expert has its own)
    sparsity: float = 0.0  # the gate's share of features zeroed by gaussian_top_k (Gemma 3n; 0: none)

    @nn.compact
    def __call__(self, x):
        a, kw = self.config.arch, linear_kw(self.config)
        if a.hidden_act == "xielu":  # learned scalars: a submodule of this MLP
            act = XIELU(self.config.execution.param_dtype, name="xielu")
        else:
            act = activation(a.hidden_act)
        width = self.width or a.intermediate_size

        def linear(name):
            return Linear((width,), (ax.EMBED, ax.MLP), a.mlp_bias, name=name, **kw)

        gate_scale, down_scale = (a.multipliers or NO_MULTIPLIERS).mlp  # Falcon-H1's (1, 1 elsewhere)
        if a.mlp_type == "gated":
            up, gate = linear("up"), linear("gate")
            up, gate = fused([up, gate], x) if fuses(self.config.execution) else (up(x), gate(x))
            if gate_scale != 1.0:
                gate = gate * jnp.asarray(gate_scale, gate.dtype)
            if self.sparsity:  # (per_layer.py imports this module)
                from shardzoo.models.per_layer import gaussian_top_k

                gate = gaussian_top_k(gate, self.sparsity)
            gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")  # what save_qkv_mlp keeps
            h = swiglu(gate, up) if a.hidden_act in ("silu", "swish") else act(gate) * up
        else:
            h = act(checkpoint_name(linear("up")(x), "mlp_up"))
        if a.sub_norms:  # BitNet's ffn_sub_norm (norms.py imports this module)
            from shardzoo.models.norms import make_norm

            h = make_norm(self.config, "sub_norm", (ax.MLP,))(h)
        h = checkpoint_name(constrain(h, (ax.BATCH, ax.LENGTH, ax.MLP), self.placement), "mlp_hidden")
        out = Linear((a.hidden_size,), (ax.MLP, ax.EMBED), a.mlp_bias, name="down", **kw)(h)
        if down_scale != 1.0:
            out = out * jnp.asarray(down_scale, out.dtype)
        return checkpoint_name(out, "mlp_out")  # [batch, length, embed]


# ------------------------------------------------------------------------------ the component
DENSE = "dense"  # its name in mlp_layer_types
BLF = (ax.BATCH, ax.LENGTH, ax.MLP)


def mlp_params(a, width: int) -> tuple[int, int]:
    """A dense MLP of ``width`` (``mlp_type``'s): (gate (gated), up and down; their biases and sub-norm)."""
    from shardzoo.models.norms import norm_params  # (norms.py imports this module)

    per = 2 if a.mlp_type == "gated" else 1
    sub_norm = norm_params(a, width) * a.sub_norms  # BitNet's ffn_sub_norm
    return (per + 1) * a.hidden_size * width, a.mlp_bias * (per * width + a.hidden_size) + sub_norm


def _params(a, active: bool) -> tuple[int, int]:
    matmul, other = mlp_params(a, a.intermediate_size)
    return matmul, other + 2 * (a.hidden_act == "xielu")  # xIELU's alpha_p and alpha_n (beta, eps: buffers)


def _activations(cost) -> dict:
    """mlp_up, mlp_hidden; gated: mlp_gate, mlp_proj (the fused up|gate output), mlp_act (another
    activation than SiLU); xielu's four residuals (models/costs.py's doc)."""
    a, e, t, f = cost.config.arch, cost.config.execution, cost.t, cost.config.arch.intermediate_size
    out = {"mlp_up": t(f, BLF), "mlp_hidden": t(f, BLF)}
    if a.mlp_type == "gated":
        out.update(mlp_gate=t(f, BLF), mlp_proj=t(f, BLF) if fuses(e) else 0)
        if a.hidden_act not in ("silu", "swish"):  # no hand-written backward (swiglu's)
            out["mlp_act"] = t(f, BLF)
    if a.hidden_act == "xielu":  # its residuals: alpha_p x, expm1's derivative, both branches' sums
        out["xielu"] = t(4 * f, BLF)
    return out


MLP_KIND = Mlp(DENSE, lambda block, h, segment_ids: MLP(block.config, block.placement, name="mlp")(h), _params,
               _activations)
