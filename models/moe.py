"""Mixture-of-Experts feed-forward layer (Switch / GShard / Mixtral), with pluggable dispatch.

``MoeMLP`` replaces a Transformer block's MLP: a router (``models/moe_routing.py``) picks
``num_experts_per_tok`` of ``num_experts`` gated (SwiGLU) experts per token and sums their
outputs, weighted by the router's probabilities (``expert_type="plain"``: experts without a
gate, ``act(x @ wi_up) @ wo``, Nemotron-H's); with ``zero_experts`` the router also scores
zero-computation experts, whose output is the token itself times their weight (LongCat-Flash:
``moe_routing.split_zero_experts``). How tokens reach the experts is
``MoeConfig.dispatch`` (``models/moe_dispatch.py``); the architecture's MoE settings are the
``moe`` sub-record (``models/moe_arch.py``); ``MLP_KIND`` is the component (``models/components.py``).

Router jitter (``router_jitter_noise > 0``, training only) multiplies the router's input by
uniform noise in ``[1 - eps, 1 + eps]`` (Switch; the experts see the clean input) and draws
from the ``"dropout"`` rng stream, which trainers pass already for dropout.

Sown per call (one scalar each, so ``nn.scan`` stacks one per layer):
``losses/moe_aux_loss`` = aux_loss_coef * load_balance + z_loss_coef * router_z_loss (already
weighted: the trainer adds it to the loss), and ``metrics/{load_balance_loss, router_z_loss,
dropped_fraction}`` (unweighted, for logging).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from shardzoo.models import DTYPES, ModelError, check_fields
from shardzoo.models.component import Mlp
from shardzoo.models.layers import (
    ACTIVATIONS,
    BLF,
    MLP,
    Linear,
    constrain,
    fuses,
    linear_kw,
    mlp_params,
)
from shardzoo.models.layers import MLP_KIND as DENSE_MLP_KIND
from shardzoo.models.moe_arch import DENSE_AND_MOE, EXPERT_TYPES, MOE, ROUTERS, MoeArch
from shardzoo.models.moe_dispatch import (
    DISPATCHES,
    GMM_DTYPES,
    MoeError,
    capacity_dispatch,
    capacity_masks,
    expert_capacity,
    gated_activation,
    gmm_dispatch,
    indexed_dispatch,
    indexed_slots,
    resolve_dispatch,
    shard_map_dispatch,
    sorted_dispatch,
)
from shardzoo.models.moe_routing import choose_experts, router_losses, split_zero_experts
from shardzoo.models.norms import RMSNorm, make_norm, norm_params
from shardzoo.sharding import axes as ax


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Settings of one MoE layer; the defaults are Mixtral-8x7B's."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    intermediate_size: int = 14336
    hidden_act: str = "silu"  # gated: act(x @ wi_gate) * (x @ wi_up)
    expert_type: str = "gated"  # EXPERT_TYPES; "plain": act(x @ wi_up), no wi_gate (Nemotron-H)
    dispatch: str = "indexed"  # DISPATCHES
    capacity_factor: float = 1.25
    router_jitter_noise: float = 0.0
    norm_topk_prob: bool = True  # renormalise the k chosen probabilities to sum to 1 (Mixtral)
    router_kind: str = "softmax"  # ROUTERS: how the k experts are chosen (``choose_experts``)
    n_group: int = 1  # expert groups of the group-limited routers
    topk_group: int = 1  # groups a token's experts may come from
    routed_scaling_factor: float = 1.0  # the chosen experts' weights times this (DeepSeek)
    router_bias: bool = False  # the router's logits have a bias (GPT-OSS)
    expert_bias: bool = False  # biases on each expert's gate, up and down (GPT-OSS)
    output_bias: bool = False  # one bias on the layer's output, the experts' weighted sum (JetMoE)
    swiglu_limit: float | None = None  # the clamped SwiGLU of ``gated_activation`` (GPT-OSS); None: act(g) * u
    swiglu_alpha: float = 1.702
    sparsemixer_eps: float = 0.01  # router_kind sparsemixer's mask threshold
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    router_norm_eps: float = 1e-6  # the scaled_softmax router's RMS norm
    zero_experts: int = 0  # zero-computation (identity) experts the router scores beside num_experts
    dtype: str = "float32"  # compute dtype of the experts; the router is always float32
    param_dtype: str = "float32"
    initializer_range: float = 0.02

    def __post_init__(self):
        where = "MoeConfig"
        choices = {"dispatch": DISPATCHES, "router_kind": ROUTERS, "expert_type": EXPERT_TYPES, "hidden_act": tuple(ACTIVATIONS), "dtype": DTYPES,
                   "param_dtype": DTYPES}
        check_fields(self, choices, ("num_experts", "num_experts_per_tok", "intermediate_size"), MoeError)
        if not 1 <= self.num_experts_per_tok <= self.num_experts + self.zero_experts:
            raise MoeError(
                f"{where}: num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"1..num_experts={self.num_experts} + zero_experts={self.zero_experts}"
            )
        if not self.capacity_factor > 0:
            raise MoeError(f"{where}: capacity_factor={self.capacity_factor} must be > 0")
        if not 0 <= self.router_jitter_noise < 1:
            raise MoeError(f"{where}: router_jitter_noise={self.router_jitter_noise} must be in [0, 1)")
        if self.dispatch == "gmm" and self.dtype not in GMM_DTYPES:
            raise MoeError(f"{where}: dispatch='gmm' multiplies {' or '.join(GMM_DTYPES)}, not dtype={self.dtype!r}")
        if self.expert_type == "plain" and (self.expert_bias or self.swiglu_limit is not None):
            raise MoeError(f"{where}: expert_type='plain' (no gate) takes neither expert_bias nor swiglu_limit")

    @classmethod
    def of(cls, arch, execution) -> MoeConfig:
        """A model's MoE layer: ``arch.moe`` and the execution's dispatch, capacity, z-loss and dtypes."""
        m = arch.moe
        return cls(
            num_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok, intermediate_size=arch.expert_size,
            hidden_act=arch.hidden_act, dispatch=execution.moe_dispatch, capacity_factor=execution.capacity_factor,
            router_jitter_noise=m.router_jitter_noise, norm_topk_prob=m.norm_topk_prob, router_kind=m.router_kind,
            n_group=m.n_group, topk_group=m.topk_group, routed_scaling_factor=m.routed_scaling_factor,
            aux_loss_coef=m.router_aux_loss_coef, router_bias=m.router_bias, expert_bias=m.expert_bias, output_bias=m.output_bias,
            swiglu_limit=m.swiglu_limit, swiglu_alpha=m.swiglu_alpha, expert_type=m.expert_type, sparsemixer_eps=m.sparsemixer_eps,
            z_loss_coef=execution.router_z_loss_coef, dtype=execution.dtype, param_dtype=execution.param_dtype,
            initializer_range=arch.initializer_range, router_norm_eps=arch.rms_norm_eps, zero_experts=m.zero_expert_num)

    def capacity(self, group_size: int) -> int:
        """Slots per expert in a group of ``group_size`` tokens (never more than the group)."""
        return expert_capacity(self.capacity_factor, group_size, self.num_experts_per_tok, self.num_experts)



class MoeMLP(nn.Module):
    """Top-k routed MLP experts (gated, or plain): x [batch, length, embed] -> [batch, length, embed]."""

    config: MoeConfig
    placement: object = None  # sharding.partition.Placement (None: one device)

    @nn.compact
    def __call__(self, x, deterministic: bool = True, token_mask=None, router_x=None):
        """``token_mask`` [batch, length]: the real tokens (padding takes no slot, no loss);
        ``router_x``: what the router reads where it is not ``x`` (Gemma 4: the residual stream)."""
        cfg = self.config
        _, length, embed = x.shape
        num_experts, mlp = cfg.num_experts, cfg.intermediate_size
        scored = num_experts + cfg.zero_experts  # what the router scores: routed and zero-computation experts
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        init = nn.initializers.normal(cfg.initializer_range)
        gated = cfg.expert_type == "gated"
        act = gated_activation(ACTIVATIONS[cfg.hidden_act], cfg.swiglu_limit, cfg.swiglu_alpha, gated)

        # Router, in float32.
        router_in = (x if router_x is None else router_x).astype(jnp.float32)
        scaled = cfg.router_kind == "scaled_softmax"
        if scaled:  # Gemma 4: RMS-normalised, times a learned vector and 1/sqrt(embed)
            router_in = RMSNorm(cfg.router_norm_eps, "float32", cfg.param_dtype, use_scale=False,
                                name="router_norm")(router_in)
            scale = self.param("router_scale", nn.with_logical_partitioning(nn.initializers.ones, (ax.EMBED,)),
                               (embed,), param_dtype)
            router_in = router_in * scale.astype(jnp.float32) * embed**-0.5
        if not deterministic and cfg.router_jitter_noise > 0:
            eps = cfg.router_jitter_noise
            noise = jax.random.uniform(self.make_rng("dropout"), x.shape, jnp.float32, 1 - eps, 1 + eps)
            router_in = router_in * noise
        logits = nn.Dense(
            scored,
            use_bias=cfg.router_bias,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            kernel_init=nn.with_logical_partitioning(init, (ax.EMBED, ax.EXPERT)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (ax.EXPERT,)),
            name="router",
        )(router_in)  # [batch, length, expert]
        bias = None
        if cfg.router_kind in ("sigmoid_groups", "softmax_bias", "logit_bias"):  # trained by no gradient (top_k's choice)
            bias = self.param("router_bias", nn.with_logical_partitioning(nn.initializers.zeros, (ax.EXPERT,)),
                              (scored,), jnp.float32)
        probs, top_p, top_idx = choose_experts(logits, cfg, bias)  # top_*: [batch, length, k]
        if scaled:  # each chosen expert's weight times its own scale
            per_expert = self.param("per_expert_scale", nn.with_logical_partitioning(
                nn.initializers.ones, (ax.EXPERT,)), (num_experts,), param_dtype).astype(jnp.float32)
            top_p = top_p * per_expert[top_idx]
        load_balance, z_loss = router_losses(logits, probs, top_idx, token_mask)
        chosen_idx, identity = top_idx, None
        if cfg.zero_experts:  # LongCat-Flash: the identity experts' weights apart, the rest routed
            top_idx, top_p, identity, zero = split_zero_experts(top_idx, top_p, num_experts)

        def expert_param(name, shape, names):
            w = self.param(name, nn.with_logical_partitioning(init, names), shape, param_dtype)
            return w.astype(dtype)

        wi_gate = expert_param("wi_gate", (num_experts, embed, mlp), (ax.EXPERT, ax.EMBED, ax.MLP)) if gated else None
        wi_up = expert_param("wi_up", (num_experts, embed, mlp), (ax.EXPERT, ax.EMBED, ax.MLP))
        wo = expert_param("wo", (num_experts, mlp, embed), (ax.EXPERT, ax.MLP, ax.EMBED))
        biases = None
        if cfg.expert_bias:
            zeros = nn.initializers.zeros
            biases = tuple(self.param(name, nn.with_logical_partitioning(zeros, names), shape, param_dtype).astype(dtype)
                           for name, shape, names in (
                               ("wi_gate_bias", (num_experts, mlp), (ax.EXPERT, ax.MLP)),
                               ("wi_up_bias", (num_experts, mlp), (ax.EXPERT, ax.MLP)),
                               ("wo_bias", (num_experts, embed), (ax.EXPERT, ax.EMBED))))
        x = x.astype(dtype)
        scale_input = cfg.router_kind == "sigmoid_input"  # the weights scale what each expert reads

        kind = resolve_dispatch(cfg.dispatch, self.placement, cfg.dtype, bool(cfg.swiglu_limit))
        if kind == "gmm" and self.is_initializing():  # the same numbers without the kernel (or a mesh)
            kind = "dropless"
        if kind in ("dropless", "gmm"):
            route = sorted_dispatch if kind == "dropless" else functools.partial(
                gmm_dispatch, placement=self.placement, wide_hidden=cfg.swiglu_limit is not None)
            y = route(x, top_idx, top_p, wi_gate, wi_up, wo, act, biases=biases, scale_input=scale_input,
                      token_mask=token_mask, whole=False if identity is not None else None)  # zero experts: apart
            dropped = jnp.zeros((), jnp.float32)
        elif kind == "indexed":
            source, slot, dropped = indexed_slots(top_idx, num_experts, cfg.capacity(length), token_mask)
            y = indexed_dispatch(x, source, slot, top_p, wi_gate, wi_up, wo, act, self.placement, biases,
                                 scale_input)
        else:
            dispatch, combine, dropped = capacity_masks(
                top_idx, top_p, num_experts, cfg.capacity(length), token_mask)
            if scale_input:  # weighted buffers in, plain sums out
                dispatch, combine = combine, dispatch
            dispatch, combine = dispatch.astype(dtype), combine.astype(dtype)
            # init runs the einsum path (same params, same output), so a shard_map layer can be
            # initialised or shape-evaluated without a mesh (planning, checkpoint import).
            explicit = kind == "shard_map" and not self.is_initializing()
            route = shard_map_dispatch if explicit else capacity_dispatch
            y = route(x, dispatch, combine, wi_gate, wi_up, wo, act, self.placement, biases)

        if identity is not None:  # the zero-computation experts' outputs: the input times their weights
            y = y + x * identity.astype(dtype)
        if identity is not None and kind not in ("dropless", "gmm"):
            # their choices are not dispatched, and not drops: the fraction is of the routed choices
            routed = x.shape[0] * length if token_mask is None else jnp.maximum(token_mask.sum(), 1)
            zeros = (zero if token_mask is None else zero & token_mask[..., None]).sum()
            total = routed * cfg.num_experts_per_tok
            dropped = (dropped * total - zeros) / jnp.maximum(total - zeros, 1)
        aux = cfg.aux_loss_coef * load_balance + cfg.z_loss_coef * z_loss
        self.sow("losses", "moe_aux_loss", aux)
        self.sow("metrics", "load_balance_loss", load_balance)
        self.sow("metrics", "router_z_loss", z_loss)
        self.sow("metrics", "dropped_fraction", dropped)
        if bias is not None:  # each expert's share of the (token, choice) pairs, for aux-loss-free balancing
            chosen = jax.nn.one_hot(chosen_idx, scored, dtype=jnp.float32).sum(-2)  # [batch, length, expert]
            if token_mask is not None:
                chosen = chosen * token_mask[..., None].astype(jnp.float32)
            self.sow("router_load", "expert_load", chosen.sum((0, 1)) / jnp.maximum(chosen.sum(), 1.0))
        if cfg.output_bias:
            y = y + self.param("output_bias", nn.with_logical_partitioning(nn.initializers.zeros, (ax.EMBED,)),
                               (embed,), param_dtype).astype(y.dtype)
        return constrain(y.astype(dtype), (ax.BATCH, ax.LENGTH, ax.EMBED), self.placement)


# ------------------------------------------------------------------------------ the component
BLX = (ax.BATCH, ax.LENGTH, ax.EXPERT)
BLEC = (ax.BATCH, ax.LENGTH, ax.EXPERT, ax.CAPACITY)  # dispatch and combine masks
ECD = (ax.EXPERT, ax.BATCH, ax.CAPACITY, ax.EMBED)  # expert buffers
ECF = (ax.EXPERT, ax.BATCH, ax.CAPACITY, ax.MLP)


def _apply(block, h, segment_ids):
    """The routed experts, plus the shared expert: a dense MLP (``mlp_type``'s) every token goes
    through, scaled by ``sigmoid(h . w)`` per token with ``shared_expert_gate`` (Qwen2-MoE); the
    sum normed with ``post_moe_norm`` (A.X-K1)."""
    config, m = block.config, block.config.arch.moe
    token_mask = None if segment_ids is None else segment_ids > 0  # 0: padding
    out = MoeMLP(config.moe_config(), block.placement, name="moe")(h, block.deterministic, token_mask)
    if m.shared_expert_intermediate_size:
        shared = MLP(config, block.placement, m.shared_expert_intermediate_size, name="shared_expert")(h)
        if m.shared_expert_gate:
            gate = Linear((), (ax.EMBED,), name="shared_expert_gate", **linear_kw(config))(h)  # [batch, length]
            shared = shared * jax.nn.sigmoid(gate)[..., None].astype(shared.dtype)
        out = out + shared  # [batch, length, embed]
    return make_norm(config, "post_moe_norm")(out) if m.post_moe_norm else out


def _apply_beside(block, x, segment_ids):
    """Gemma 4's MoE block, of the residual stream ``x``: post_mlp_norm_1(mlp(mlp_norm(x))) +
    post_moe_norm(experts(moe_norm(x)), routed by x itself); the block form norms the sum."""
    config = block.config
    token_mask = None if segment_ids is None else segment_ids > 0
    dense = MLP(config, block.placement, name="mlp")(make_norm(config, "mlp_norm")(x))
    routed = MoeMLP(config.moe_config(), block.placement, name="moe")(
        make_norm(config, "moe_norm")(x), block.deterministic, token_mask, router_x=x)
    return make_norm(config, "post_mlp_norm_1")(dense) + make_norm(config, "post_moe_norm")(routed)


def _params(a, active: bool) -> tuple[int, int]:
    """(the router, the experts (``active``: the top-k, each counted as a routed expert: with
    zero-computation experts an upper bound) and the shared expert; the router's and
    experts' biases, the correction bias of softmax_bias (a parameter in transformers; sigmoid_groups':
    a buffer), the shared expert's biases, the output's norm)."""
    m, d = a.moe, a.hidden_size
    e, fe, z = m.num_local_experts, a.expert_size, a.moe.zero_expert_num
    shared, shared_bias = mlp_params(a, m.shared_expert_intermediate_size)
    per_expert = (3 if m.expert_type == "gated" else 2) * d * fe  # gate (gated), up, down
    matmul = d * (e + z) + (m.num_experts_per_tok if active else e) * per_expert + shared + d * m.shared_expert_gate
    # the correction bias with zero experts (LongCat-Flash's) is a buffer in transformers (costs.buffers)
    other = (e + z) * (m.router_bias + (m.router_kind == "softmax_bias" and not z)) + e * m.expert_bias * (2 * fe + d)
    other += norm_params(a, d) if m.post_moe_norm else 0
    other += d * m.output_bias
    other += (d + e) * (m.router_kind == "scaled_softmax")  # its input's scale, each expert's scale
    return matmul, other + (shared_bias if m.shared_expert_intermediate_size else 0)


def _params_beside(a, active: bool) -> tuple[int, int]:
    """The dense MLP, the experts and their three norms of their own (post_mlp_norm_1, moe_norm, post_moe_norm)."""
    dense, moe = mlp_params(a, a.intermediate_size), _params(a, active)
    return dense[0] + moe[0], dense[1] + moe[1] + 3 * norm_params(a, a.hidden_size)


def _activations(cost) -> dict:
    """The router's float32 softmax and z-loss exp; the one-hot dispatch and combine masks of the
    einsum dispatches (the indexed one keeps a few int32 slot indices per token: not counted);
    the expert buffers in and out; the experts' projections and hidden arrays (gated: gate and up,
    silu's residuals and their product; plain: up and the activation's output); the clamped
    SwiGLU's three more; the shared expert's; the output norm's float32 intermediates (models/costs.py's doc)."""
    config, t, length = cost.config, cost.t, cost.seq_len
    a, m, e = config.arch, config.arch.moe, config.execution
    experts, d, fe, gated = m.num_local_experts, a.hidden_size, a.expert_size, m.expert_type == "gated"
    slots = experts * config.moe_config().capacity(length)  # E*C per row, per token: / L
    scored = experts + m.zero_expert_num  # the router's columns
    out = {"router_logits": t(scored, BLX, 4), "router": t(2 * scored, BLX, 4),
           "masks": t(2 * slots, BLEC) if e.moe_dispatch in ("capacity", "shard_map") else 0,
           "expert_in": t(slots * d / length, ECD), "expert_out": t(slots * d / length, ECD),
           "expert_proj": t((2 if gated else 1) * slots * fe / length, ECF),
           "expert_hidden": t((4 if gated else 1) * slots * fe / length, ECF)}
    if m.swiglu_limit:  # the clamped SwiGLU's min and clip outputs and sigmoid(alpha g)
        out["expert_clamp"] = t(3 * slots * fe / length, ECF)
    if m.post_moe_norm:
        out["post_moe_norm"] = t(3 * d, (ax.BATCH, ax.LENGTH, ax.EMBED), 4)
    fs = m.shared_expert_intermediate_size
    if fs:  # a dense MLP's terms at its width (its gate: 1 per token)
        out.update(shared_up=t(fs, BLF), shared_hidden=t(fs, BLF))
        if a.mlp_type == "gated":
            out.update(shared_gate=t(fs, BLF), shared_proj=t(fs, BLF) if fuses(e) else 0)
    return out


def _activations_beside(cost) -> dict:
    """The dense MLP's terms and the experts' (their norms' as the block's: 3 D float32 each)."""
    t, d = cost.t, cost.config.arch.hidden_size
    return DENSE_MLP_KIND.activations(cost) | _activations(cost) | {
        "moe_norms": t(9 * d, (ax.BATCH, ax.LENGTH, ax.EMBED), 4)}


def _check_beside(a) -> None:
    if a.block_form != "sequential" or a.norm_position != "both":
        raise ModelError(f"mlp_layer_types {DENSE_AND_MOE} (Gemma 4's MoE block) sits between the norms of "
                         f"norm_position 'both' in sequential blocks; got block_form={a.block_form!r}, "
                         f"norm_position={a.norm_position!r}")


MLP_KIND = Mlp(MOE, _apply, _params, _activations, records=(MoeArch,))
DENSE_AND_MOE_KIND = Mlp(DENSE_AND_MOE, _apply_beside, _params_beside, _activations_beside, _check_beside,
                         (MoeArch,), reads_residual=True)
