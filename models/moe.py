"""Mixture-of-Experts feed-forward layer (Switch / GShard / Mixtral), with pluggable dispatch.

``MoeMLP`` replaces a Transformer block's MLP: a router picks ``num_experts_per_tok`` of
``num_experts`` gated (SwiGLU) experts per token and sums their outputs, weighted by the
router's probabilities (``expert_type="plain"``: experts without a gate, ``act(x @ wi_up) @ wo``,
Nemotron-H's). Ways to send tokens to experts, chosen by ``MoeConfig.dispatch``:

- ``indexed`` (the default): each row's (token, expert) assignments sorted by expert, the tokens
  gathered into fixed ``[expert, batch, capacity, embed]`` buffers by index, every expert's
  matmul on its buffer, the outputs gathered back by index and weighted. Costs grow with the
  tokens, not with experts x capacity; the same buffers, drops and sharding as ``capacity``.
- ``capacity``: GShard einsum dispatch into the same buffers through one-hot
  ``[batch, length, expert, capacity]`` masks (cost: tokens x experts x capacity x embed).
  The expert dimension is a logical axis, so rules mapping ``expert`` to a mesh axis (``ep``)
  give expert parallelism, with XLA inserting the all-to-all. Tokens over capacity are dropped.
- ``dropless``: tokens sorted by expert and ``jax.lax.ragged_dot``; nothing is dropped, padding
  takes no row. The GPU/TPU path: on CPU, ragged_dot computes every group densely (correct, slow).
- ``gmm``: the dropless sort, the experts' matmuls by megablox's Pallas grouped matmul
  (``jax.experimental.pallas.ops.tpu.megablox.gmm``, whose backward is ``gmm`` and ``tgmm``):
  the TPU path (off a TPU it runs in Pallas' interpret mode: correct, slow, for tests). GSPMD
  cannot split a Pallas call, so on a mesh it runs in a ``shard_map`` with each device's
  tokens (the mesh axes of ``batch`` and ``length``) and every expert whole there: rules that
  shard ``expert`` or ``mlp`` have the weights gathered each layer (as FSDP's are).
- ``shard_map``: the capacity buffers, exchanged explicitly with ``jax.lax.all_to_all`` over
  the mesh axes that the layer's placement gives ``expert``.
- ``auto``: ``gmm`` on a TPU where the rules leave each expert whole on a device (no mesh
  axis on ``expert`` or ``mlp``) and the dtype is float32 or bfloat16; ``indexed``
  everywhere else. It is not the default: it is dropless on a TPU but drops over capacity
  elsewhere, so one config would train differently by platform.

Groups and priority (``indexed``, ``capacity`` and ``shard_map``): a group is one batch row.
Each expert takes at most ``capacity = min(length, ceil(capacity_factor * length * k /
num_experts))`` assignments per row, filled in GShard/Switch priority: every token's top-1 choice in token
order, then every top-2 choice in token order, and so on. A dropped assignment contributes 0
to the layer's output; the block's residual add carries the token on.

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
import math

import einops
import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from shardzoo.models import DTYPES, ModelError, check_fields
from shardzoo.models.component import Mlp
from shardzoo.models.layers import ACTIVATIONS, BLF, MLP, Linear, constrain, linear_kw, mlp_params
from shardzoo.sharding import axes as ax

MOE = "moe"  # its name in mlp_layer_types
DISPATCHES = ("indexed", "capacity", "dropless", "gmm", "shard_map", "auto")
GMM_DTYPES = ("float32", "bfloat16")  # what megablox multiplies
EXPERT_TYPES = ("gated", "plain")  # act(x @ wi_gate) * (x @ wi_up), or act(x @ wi_up): the hidden before wo
ROUTERS = ("softmax", "softmax_groups", "sigmoid_groups", "sigmoid_input", "softmax_bias")  # see ``choose_experts``


class MoeError(ModelError):
    """A MoE setting the user gave cannot be honoured (a config value, the rules or the mesh)."""


class ExpertAxisError(MoeError):
    """``dispatch="shard_map"`` but the placement puts ``expert`` on no mesh axis of size > 1."""


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
    swiglu_limit: float | None = None  # the clamped SwiGLU of ``gated_activation`` (GPT-OSS); None: act(g) * u
    swiglu_alpha: float = 1.702
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    dtype: str = "float32"  # compute dtype of the experts; the router is always float32
    param_dtype: str = "float32"
    initializer_range: float = 0.02

    def __post_init__(self):
        where = "MoeConfig"
        choices = {"dispatch": DISPATCHES, "router_kind": ROUTERS, "expert_type": EXPERT_TYPES, "hidden_act": tuple(ACTIVATIONS), "dtype": DTYPES,
                   "param_dtype": DTYPES}
        check_fields(self, choices, ("num_experts", "num_experts_per_tok", "intermediate_size"), MoeError)
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise MoeError(
                f"{where}: num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"1..num_experts={self.num_experts}"
            )
        if not self.capacity_factor > 0:
            raise MoeError(f"{where}: capacity_factor={self.capacity_factor} must be > 0")
        if not 0 <= self.router_jitter_noise < 1:
            raise MoeError(f"{where}: router_jitter_noise={self.router_jitter_noise} must be in [0, 1)")
        if self.dispatch == "gmm" and self.dtype not in GMM_DTYPES:
            raise MoeError(f"{where}: dispatch='gmm' multiplies {' or '.join(GMM_DTYPES)}, not dtype={self.dtype!r}")
        if self.expert_type == "plain" and (self.expert_bias or self.swiglu_limit is not None):
            raise MoeError(f"{where}: expert_type='plain' (no gate) takes neither expert_bias nor swiglu_limit")

    def capacity(self, group_size: int) -> int:
        """Slots per expert in a group of ``group_size`` tokens (never more than the group)."""
        k, e = self.num_experts_per_tok, self.num_experts
        return max(1, min(group_size, math.ceil(self.capacity_factor * group_size * k / e)))


def gated_activation(act, limit: float | None = None, alpha: float = 1.702, gated: bool = True):
    """``(gate, up) -> hidden`` of a gated expert: ``act(gate) * up``, or with ``limit`` GPT-OSS's
    clamped SwiGLU ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, g = min(gate, limit)
    (transformers' ``GptOssExperts._apply_gate``). Not ``gated``: ``act(up)`` (gate is None)."""
    if not gated:
        return lambda gate, up: act(up)
    if limit is None:
        return lambda gate, up: act(gate) * up

    def clamped(gate, up):
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))

    return clamped


def top_k(probs, k: int):
    """``jax.lax.top_k`` over the last axis as k argmaxes (ties go to the lower index, as there).

    XLA's TopK all-gathers a batch-sharded input (seen on CPU: the whole batch's router
    probabilities on every device); argmax partitions along batch like any reduction.
    """
    num_experts, masked, idx = probs.shape[-1], probs, []
    for _ in range(k):
        idx.append(jnp.argmax(masked, axis=-1))
        masked = jnp.where(jax.nn.one_hot(idx[-1], num_experts, dtype=bool), -jnp.inf, masked)
    idx = jnp.stack(idx, axis=-1)
    return jnp.take_along_axis(probs, idx, axis=-1), idx


def _group_mask(scores, n_group: int, topk_group: int, group_score):
    """Bool [..., expert]: the experts of the ``topk_group`` groups (of ``n_group`` equal runs of
    experts) that ``group_score`` [..., group, experts_per_group] -> [..., group] ranks best."""
    *lead, num_experts = scores.shape
    grouped = scores.reshape(*lead, n_group, num_experts // n_group)
    _, best = top_k(group_score(grouped), topk_group)  # [..., topk_group]
    chosen = jax.nn.one_hot(best, n_group, dtype=bool).any(-2)  # [..., group]
    return jnp.repeat(chosen, num_experts // n_group, axis=-1)


def choose_experts(logits, cfg: MoeConfig, bias=None):
    """(probs, top_p, top_idx) of router ``logits`` [..., expert] by ``cfg.router_kind``:

    - ``softmax``: the k most probable experts of the softmax (Mixtral, DeepSeek-V2 greedy);
    - ``softmax_groups``: the same within the ``topk_group`` groups whose best probability is
      highest (DeepSeek-V2's group_limited_greedy; the other groups' probabilities count as 0);
    - ``sigmoid_groups``: sigmoid scores; the choice adds the correction ``bias`` [expert]
      (DeepSeek-V3's e_score_correction_bias), ranks groups by the sum of their two best and
      picks the k best within the ``topk_group`` best groups; the weights are the unbiased scores.
    - ``sigmoid_input``: the k largest logits, weights their sigmoid (Llama 4); ``MoeMLP``
      scales each chosen expert's input by its weight, not its output.
    - ``softmax_bias``: the k experts whose softmax probability plus the correction ``bias``
      [expert] is highest; the weights are their unbiased probabilities (Ernie 4.5 MoE's
      moe_statics.e_score_correction_bias).

    ``norm_topk_prob`` renormalises the k weights, then ``routed_scaling_factor`` scales them.
    ``probs`` is what the load-balancing loss takes (the softmax, or the normalised scores).
    """
    k, kind = cfg.num_experts_per_tok, cfg.router_kind
    if kind == "sigmoid_input":
        top_logits, top_idx = top_k(logits, k)
        top_p = jax.nn.sigmoid(top_logits)
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
        eps = 1e-20
    elif kind == "sigmoid_groups":
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias
        keep = _group_mask(choice, cfg.n_group, cfg.topk_group, lambda g: top_k(g, 2)[0].sum(-1))
        _, top_idx = top_k(jnp.where(keep, choice, -jnp.inf), k)
        top_p = jnp.take_along_axis(scores, top_idx, axis=-1)
        probs = scores / scores.sum(-1, keepdims=True)
        eps = 1e-20  # transformers' denominator guard
    elif kind == "softmax_bias":
        probs = jax.nn.softmax(logits, axis=-1)
        _, top_idx = top_k(probs + bias, k)
        top_p = jnp.take_along_axis(probs, top_idx, axis=-1)
        eps = 0.0
    else:
        probs = jax.nn.softmax(logits, axis=-1)
        masked = probs
        if kind == "softmax_groups":
            masked = jnp.where(_group_mask(probs, cfg.n_group, cfg.topk_group, lambda g: g.max(-1)), probs, 0.0)
        top_p, top_idx = top_k(masked, k)  # [..., k]
        eps = 0.0
    if cfg.norm_topk_prob:
        top_p = top_p / (top_p.sum(-1, keepdims=True) + eps)
    if cfg.routed_scaling_factor != 1.0:
        top_p = top_p * cfg.routed_scaling_factor
    return probs, top_p, top_idx


def router_losses(logits, probs, top_idx, token_mask=None):
    """(load_balance, z_loss) of router ``logits`` [..., expert] and its top-k choices.

    load_balance = num_experts * sum_e f_e * P_e as HF Mixtral's ``load_balancing_loss_func``:
    f_e = top-k assignments to e per token (summed over the k choices, so it equals k at
    perfect balance), P_e = mean router probability of e. z_loss = mean logsumexp(logits)^2.
    Means are over the tokens where ``token_mask`` [...] is true (all without one), as HF's
    with an attention mask: padding does not count.
    """
    num_experts = logits.shape[-1]
    w = jnp.ones(logits.shape[:-1], jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
    w = w.reshape(-1) / jnp.maximum(w.sum(), 1.0)  # [tokens], sums to 1
    f = jax.nn.one_hot(top_idx, num_experts, dtype=jnp.float32).sum(-2)  # [..., expert]
    f = w @ f.reshape(-1, num_experts)  # [expert]
    p = w @ probs.reshape(-1, num_experts)  # [expert]
    z = jax.nn.logsumexp(logits, axis=-1).reshape(-1)
    return num_experts * jnp.sum(f * p), jnp.sum(w * z**2)


def capacity_masks(top_idx, top_p, num_experts: int, capacity: int, token_mask=None):
    """GShard dispatch and combine tensors with one group per batch row.

    top_idx, top_p: [batch, length, k]; token_mask [batch, length]: tokens to route (padding is
    not: it takes no slot). Returns dispatch (0/1) and combine (gate weights), both
    [batch, length, expert, capacity], and the fraction of the routed tokens' assignments dropped.
    """
    b, length, k = top_idx.shape
    mask = jax.nn.one_hot(top_idx, num_experts, dtype=jnp.int32)  # [batch, length, k, expert]
    routed = b * length
    if token_mask is not None:
        mask = mask * token_mask[:, :, None, None].astype(jnp.int32)
        routed = jnp.maximum(token_mask.sum(), 1)
    # Priority order within a row: all top-1 choices in token order, then all top-2 choices, ...
    by_choice = einops.rearrange(mask, "b l k e -> b (k l) e")
    filled = jnp.cumsum(by_choice, axis=1) * by_choice  # 1-based slot where assigned, else 0
    # back to tokens; at most one of a token's k choices names a given expert
    filled = einops.reduce(filled, "b (k l) e -> b l e", "sum", k=k)
    # one_hot of -1 (not chosen) or of >= capacity (over capacity) is all zeros: that drops it.
    dispatch = jax.nn.one_hot(filled - 1, capacity, dtype=jnp.float32)  # [batch, length, expert, capacity]
    gate = (mask * top_p[..., None]).sum(2)  # [batch, length, expert]
    combine = dispatch * gate[..., None]
    dropped = 1.0 - dispatch.sum() / (routed * k)
    return dispatch, combine, dropped


def expert_ffn(xe, wi_gate, wi_up, wo, glu, placement=None, biases=None):
    """Every expert's MLP on its own buffer: xe [expert, batch, capacity, embed].

    ``glu(gate, up)``: the gated activation (``gated_activation``; ``wi_gate`` None: a plain
    expert, gate None); ``biases``: None or the
    experts' (gate [expert, mlp], up [expert, mlp], down [expert, embed]) biases (an empty
    slot then computes a value that its zero combine weight discards).
    ``placement`` None inside shard_map, where the mesh axes are manual.
    """
    up = jnp.einsum("ebcd,edm->ebcm", xe, wi_up)
    gate = None if wi_gate is None else jnp.einsum("ebcd,edm->ebcm", xe, wi_gate)
    if biases is not None:
        gate, up = gate + biases[0][:, None, None], up + biases[1][:, None, None]
    h = constrain(glu(gate, up), (ax.EXPERT, ax.BATCH, ax.CAPACITY, ax.MLP), placement)
    out = jnp.einsum("ebcm,emd->ebcd", h, wo)  # [expert, batch, capacity, embed]
    return out if biases is None else out + biases[2][:, None, None]


def capacity_dispatch(x, dispatch, combine, wi_gate, wi_up, wo, act, placement, biases=None):
    """GShard einsum dispatch; sharding of the expert axis comes from the rules (XLA all-to-all)."""
    # Buffers are filled where the tokens live (expert dim unsharded: None), then moved to their
    # experts' owners: a change of sharding from batch to expert, which XLA does by all-to-all.
    local = (None, ax.BATCH, ax.CAPACITY, ax.EMBED)
    buffers = (ax.EXPERT, ax.BATCH, ax.CAPACITY, ax.EMBED)
    xe = jnp.einsum("blec,bld->ebcd", dispatch, x)  # [expert, batch, capacity, embed]
    xe = constrain(constrain(xe, local, placement), buffers, placement)
    ye = constrain(expert_ffn(xe, wi_gate, wi_up, wo, act, placement, biases), buffers, placement)
    ye = constrain(ye, local, placement)
    return jnp.einsum("blec,ebcd->bld", combine, ye)  # [batch, length, embed]


def indexed_slots(top_idx, num_experts: int, capacity: int, token_mask=None):
    """GShard's slots found by sorting each row's assignments by expert (same priority, drops).

    top_idx [batch, length, k]; token_mask [batch, length] (padding takes no slot). Returns
    ``source`` [batch, expert*capacity]: the token in each slot (``length``, out of range, for
    an empty one), ``slot`` [batch, length, k]: each assignment's slot (``expert*capacity``,
    out of range, where dropped or not routed), and the fraction of routed assignments dropped.
    """
    b, length, k = top_idx.shape
    # Priority order within a row: all top-1 choices in token order, then all top-2 choices, ...
    flat = einops.rearrange(top_idx, "b l k -> b (k l)")
    if token_mask is not None:  # padding sorts after every expert: it fills no slot
        flat = jnp.where(jnp.tile(token_mask, (1, k)), flat, num_experts)
    order = jnp.argsort(flat, axis=-1, stable=True)  # [batch, k*length]: by expert, then priority
    grouped = jnp.take_along_axis(flat, order, axis=-1)
    bounds = jax.vmap(functools.partial(jnp.searchsorted, v=jnp.arange(num_experts + 1)))(grouped)
    start, count = bounds[:, :-1], jnp.diff(bounds, axis=-1)  # [batch, expert]
    pos = jnp.arange(capacity)
    filled = pos < count[..., None]  # [batch, expert, capacity]
    assignment = jnp.take_along_axis(order, (start[..., None] + pos).reshape(b, -1), axis=-1, mode="clip")
    source = jnp.where(filled.reshape(b, -1), assignment % length, length)  # [batch, expert*capacity]
    rank = jnp.argsort(order, axis=-1)  # each assignment's place in expert order
    within = rank - jnp.take_along_axis(start, jnp.minimum(flat, num_experts - 1), axis=-1)
    kept = (flat < num_experts) & (within < capacity)
    slot = jnp.where(kept, flat * capacity + within, num_experts * capacity)
    routed = b * length if token_mask is None else jnp.maximum(token_mask.sum(), 1)
    dropped = 1.0 - kept.sum() / (routed * k)
    return source, einops.rearrange(slot, "b (k l) -> b l k", k=k), dropped


def indexed_dispatch(x, source, slot, top_p, wi_gate, wi_up, wo, act, placement, biases=None, scale_input=False):
    """Gather tokens into the capacity buffers, run the experts, gather back and weight
    (``scale_input``: weight each slot's input instead, and sum the outputs).

    The buffers and their sharding are ``capacity_dispatch``'s: the rules' ``expert`` axis
    moves them to their experts' owners (XLA's all-to-all under ``ep``).
    """
    num_experts = wo.shape[0]
    gather = functools.partial(jnp.take_along_axis, axis=1, mode="fill", fill_value=0)
    local = (None, ax.BATCH, ax.CAPACITY, ax.EMBED)
    buffers = (ax.EXPERT, ax.BATCH, ax.CAPACITY, ax.EMBED)
    xe = gather(x, source[..., None])  # [batch, expert*capacity, embed]; empty slots 0
    if scale_input:  # each slot's weight: its assignment's (dropped ones fall off the end)
        b, slots = xe.shape[:2]
        rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], slot.shape)
        w = jnp.zeros((b, slots), top_p.dtype).at[rows, slot].set(top_p, mode="drop")
        xe = xe * w[..., None].astype(xe.dtype)
        top_p = jnp.ones_like(top_p)
    xe = einops.rearrange(xe, "b (e c) d -> e b c d", e=num_experts)
    xe = constrain(constrain(xe, local, placement), buffers, placement)
    ye = constrain(expert_ffn(xe, wi_gate, wi_up, wo, act, placement, biases), buffers, placement)
    ye = einops.rearrange(constrain(ye, local, placement), "e b c d -> b (e c) d")
    yk = gather(ye, einops.rearrange(slot, "b l k -> b (l k)")[..., None])  # dropped: 0
    yk = einops.rearrange(yk, "b (l k) d -> b l k d", k=slot.shape[-1])
    return jnp.einsum("blkd,blk->bld", yk, top_p.astype(yk.dtype))  # [batch, length, embed]


def sorted_dispatch(x, top_idx, top_p, wi_gate, wi_up, wo, act, biases=None, scale_input=False, token_mask=None,
                    matmul=jax.lax.ragged_dot, row_multiple=1):
    """Tokens sorted by expert, each expert's rows through ``matmul(rows, weights [expert, in,
    out], group_sizes)``; no capacity, nothing dropped (``scale_input``: each assignment's input
    weighted, the outputs summed).

    Padding (``token_mask`` false) sorts after every expert, outside every group, and gives 0;
    the rows are padded to a multiple of ``row_multiple`` (the kernel's row tile). Rows outside
    the groups are never computed (a kernel may leave them unwritten), so each is masked where
    it enters and leaves a matmul, in the forward and, by ``where``, in the backward.
    """
    b, length, d = x.shape
    k, num_experts = top_idx.shape[-1], wo.shape[0]
    flat = top_idx.reshape(-1)  # [batch*length*k]
    if token_mask is not None:
        flat = jnp.where(jnp.repeat(token_mask.reshape(-1), k), flat, num_experts)
    n = flat.shape[0]
    pad = -n % row_multiple
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [expert]; padding not counted
    expert = jnp.pad(flat[order], (0, pad), constant_values=num_experts)  # [rows]: each sorted row's expert
    valid = (expert < num_experts)[:, None]
    expert = jnp.minimum(expert, num_experts - 1)
    xs = x.reshape(-1, d)[order // k]  # [batch*length*k, embed], grouped by expert
    if scale_input:
        xs = xs * top_p.reshape(-1)[order][:, None].astype(xs.dtype)
        top_p = jnp.ones_like(top_p)
    xs = jnp.where(valid, jnp.pad(xs, ((0, pad), (0, 0))), 0)  # [rows, embed]

    def project(h, w, bias):  # [rows, in] -> [rows, out], masked rows 0
        y = matmul(h, w, sizes)
        return jnp.where(valid, y if bias is None else y + bias[expert], 0)

    biases = biases or (None,) * 3
    up = project(xs, wi_up, biases[1])
    gate = None if wi_gate is None else project(xs, wi_gate, biases[0])
    ys = project(act(gate, up), wo, biases[2])[:n]  # [batch*length*k, embed]
    ys = einops.rearrange(ys[jnp.argsort(order)], "(b l k) d -> b l k d", b=b, l=length)  # token order
    return jnp.einsum("blkd,blk->bld", ys, top_p.astype(ys.dtype))


def _tile(dim: int, cap: int) -> int:
    """A tile of ``dim``: all of it up to ``cap``, else the largest multiple of 128 up to ``cap``
    that divides it, else ``cap`` (megablox masks the last, partial tile)."""
    if dim <= cap:
        return dim
    return next((t for t in range(cap - cap % 128, 0, -128) if dim % t == 0), cap)


@dataclasses.dataclass(frozen=True)
class GmmTiling:
    """megablox's tiling lookup ``(m, k, n) -> (tm, tk, tn)``, asked for each of the forward's and
    backward's shapes (the backward swaps k and n). Rows come padded by ``row_multiple``, so
    ``tm`` divides them; ``tk`` and ``tn`` divide their dimensions where a multiple of 128 can
    (MaxText's 512 x 1024 x 1024 for bfloat16; float32 halves the columns to stay in VMEM)."""

    rows: int = 512
    cols: int = 1024

    def row_multiple(self, n: int) -> int:
        """What ``n`` rows are padded to a multiple of: one tile of up to ``rows`` (a multiple of 128)."""
        return min(self.rows, -(-n // 128) * 128)

    def __call__(self, m: int, k: int, n: int) -> tuple[int, int, int]:
        return min(m, self.rows), _tile(k, self.cols), _tile(n, self.cols)


def gmm_matmul(tiling: GmmTiling, interpret: bool):
    """``(rows, weights, group_sizes) -> rows @ weights[group]`` by megablox's grouped matmul."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm  # noqa: I001 - lazily: Pallas only here

    def matmul(lhs, rhs, sizes):
        return gmm(lhs, rhs, sizes, lhs.dtype, tiling, interpret=interpret)

    return matmul


def gmm_dispatch(x, top_idx, top_p, wi_gate, wi_up, wo, act, placement, biases=None, scale_input=False,
                 token_mask=None, tiling=None, interpret=None):
    """``sorted_dispatch`` by megablox's grouped matmul; on a mesh, inside a ``shard_map`` over the
    mesh axes of the tokens' ``batch`` and ``length`` (where they divide them), every expert's
    weights whole on each device. ``interpret`` None: Pallas' interpret mode off a TPU."""
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    tiling = tiling or GmmTiling(cols=1024 if x.dtype.itemsize < 4 else 512)

    def local(x, top_idx, top_p, token_mask, weights, biases):
        matmul = gmm_matmul(tiling, interpret)
        multiple = tiling.row_multiple(top_idx.size)
        return sorted_dispatch(x, top_idx, top_p, *weights, act, biases, scale_input, token_mask, matmul, multiple)

    weights = (wi_gate, wi_up, wo)
    token_mask = jnp.ones(x.shape[:2], bool) if token_mask is None else token_mask
    if placement is None or math.prod(placement.sizes.values()) == 1:
        return local(x, top_idx, top_p, token_mask, weights, biases)
    axes = [(a,) if isinstance(a, str) else a for a in placement.spec((ax.BATCH, ax.LENGTH))]
    tokens = P(*(a if a and size % placement.size(a) == 0 else None for a, size in zip(axes, x.shape, strict=False)))
    return jax.shard_map(
        local, mesh=placement.mesh, in_specs=(tokens,) * 4 + (P(), P()), out_specs=tokens,
        check_vma=False,  # pallas_call's outputs carry no varying-axes type; each is its devices' own
    )(x, top_idx, top_p, token_mask, weights, biases)


def resolve_dispatch(dispatch: str, placement, dtype: str, clamped: bool = False) -> str:
    """The dispatch that ``auto`` stands for (see the module docstring); any other as it is.
    ``clamped`` (GPT-OSS's clamped SwiGLU): indexed, since on the chip gmm's bf16 gradients of
    clamped experts strayed 7x further from float32 than indexed's (BENCHMARKS.md, TPU)."""
    if dispatch != "auto":
        return dispatch
    split = placement is not None and any(placement.mesh_axes(n) for n in (ax.EXPERT, ax.MLP))
    tpu = jax.default_backend() == "tpu" and dtype in GMM_DTYPES
    return "gmm" if tpu and not split and not clamped else "indexed"


def shard_map_dispatch(x, dispatch, combine, wi_gate, wi_up, wo, act, placement, biases=None):
    """Explicit expert parallelism: shard_map over the mesh, all_to_all over the expert axes.

    Rows of the batch are split over the batch's mesh axes plus the expert axes; each device
    fills its rows' buffers for every expert, sends each expert's buffers to its owner, runs its
    local experts on the buffers of all peers and sends the results back.
    """
    ep_axes = placement.mesh_axes(ax.EXPERT) if placement is not None else ()
    if not ep_axes:
        assigned = placement.spec((ax.EXPERT,))[0] if placement is not None else None
        shown = "no mesh" if placement is None else ",".join(f"{n}={s}" for n, s in placement.sizes.items())
        raise ExpertAxisError(
            f"MoE dispatch 'shard_map' needs the rules to put logical axis '{ax.EXPERT}' on a mesh "
            f"axis of size > 1; the rules put it on {assigned or 'no mesh axis'} ({shown}). "
            "Use rules 'ep' with an 'expert=N' mesh, or dispatch 'capacity'."
        )
    mesh = placement.mesh
    sizes = placement.sizes
    ep = math.prod(sizes[a] for a in ep_axes)
    num_experts = wo.shape[0]
    if num_experts % ep:
        raise MoeError(
            f"num_experts={num_experts} is not divisible by the expert-parallel size {ep} "
            f"(mesh axes {', '.join(f'{a}={sizes[a]}' for a in ep_axes)})"
        )
    row_axes = tuple(a for a in placement.mesh_axes(ax.BATCH) if a not in ep_axes)
    row_axes += ep_axes
    shards = math.prod(sizes[a] for a in row_axes)
    if x.shape[0] % shards:
        raise MoeError(
            f"MoE dispatch 'shard_map': batch size {x.shape[0]} is not divisible by the "
            f"{shards} devices along mesh axes {', '.join(row_axes)}"
        )

    gated = wi_gate is not None
    weights = (wi_gate, wi_up, wo) if gated else (wi_up, wo)

    def local(x, dispatch, combine, *rest):
        # x [rows, length, embed]; dispatch, combine [rows, length, expert, capacity]
        ws, biases = rest[:len(weights)], rest[len(weights):]
        ws = ws if gated else (None, *ws)
        xe = jnp.einsum("blec,bld->ebcd", dispatch, x)  # [expert, rows, capacity, embed]
        xe = jax.lax.all_to_all(xe, ep_axes, 0, 1, tiled=True)  # [local_expert, ep*rows, capacity, embed]
        ye = expert_ffn(xe, *ws, act, biases=biases or None)
        ye = jax.lax.all_to_all(ye, ep_axes, 1, 0, tiled=True)  # [expert, rows, capacity, embed]
        return jnp.einsum("blec,ebcd->bld", combine, ye)  # [rows, length, embed]

    rows, experts = P(row_axes), P(ep_axes)
    biases = tuple(biases or ())
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows) + (experts,) * (len(weights) + len(biases)),
        out_specs=rows,
    )(x, dispatch, combine, *weights, *biases)


class MoeMLP(nn.Module):
    """Top-k routed MLP experts (gated, or plain): x [batch, length, embed] -> [batch, length, embed]."""

    config: MoeConfig
    placement: object = None  # sharding.partition.Placement (None: one device)

    @nn.compact
    def __call__(self, x, deterministic: bool = True, token_mask=None):
        """``token_mask`` [batch, length]: the real tokens (padding takes no slot, no loss)."""
        cfg = self.config
        _, length, embed = x.shape
        num_experts, mlp = cfg.num_experts, cfg.intermediate_size
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        init = nn.initializers.normal(cfg.initializer_range)
        gated = cfg.expert_type == "gated"
        act = gated_activation(ACTIVATIONS[cfg.hidden_act], cfg.swiglu_limit, cfg.swiglu_alpha, gated)

        # Router, in float32.
        router_in = x.astype(jnp.float32)
        if not deterministic and cfg.router_jitter_noise > 0:
            eps = cfg.router_jitter_noise
            noise = jax.random.uniform(self.make_rng("dropout"), x.shape, jnp.float32, 1 - eps, 1 + eps)
            router_in = router_in * noise
        logits = nn.Dense(
            num_experts,
            use_bias=cfg.router_bias,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            kernel_init=nn.with_logical_partitioning(init, (ax.EMBED, ax.EXPERT)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (ax.EXPERT,)),
            name="router",
        )(router_in)  # [batch, length, expert]
        bias = None
        if cfg.router_kind in ("sigmoid_groups", "softmax_bias"):  # trained by no gradient (top_k's choice)
            bias = self.param("router_bias", nn.with_logical_partitioning(nn.initializers.zeros, (ax.EXPERT,)),
                              (num_experts,), jnp.float32)
        probs, top_p, top_idx = choose_experts(logits, cfg, bias)  # top_*: [batch, length, k]
        load_balance, z_loss = router_losses(logits, probs, top_idx, token_mask)

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
            route = sorted_dispatch if kind == "dropless" else functools.partial(gmm_dispatch, placement=self.placement)
            y = route(x, top_idx, top_p, wi_gate, wi_up, wo, act, biases=biases, scale_input=scale_input,
                      token_mask=token_mask)
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

        aux = cfg.aux_loss_coef * load_balance + cfg.z_loss_coef * z_loss
        self.sow("losses", "moe_aux_loss", aux)
        self.sow("metrics", "load_balance_loss", load_balance)
        self.sow("metrics", "router_z_loss", z_loss)
        self.sow("metrics", "dropped_fraction", dropped)
        if bias is not None:  # each expert's share of the (token, choice) pairs, for aux-loss-free balancing
            chosen = jax.nn.one_hot(top_idx, num_experts, dtype=jnp.float32).sum(-2)  # [batch, length, expert]
            if token_mask is not None:
                chosen = chosen * token_mask[..., None].astype(jnp.float32)
            self.sow("router_load", "expert_load", chosen.sum((0, 1)) / jnp.maximum(chosen.sum(), 1.0))
        return constrain(y.astype(dtype), (ax.BATCH, ax.LENGTH, ax.EMBED), self.placement)


# ------------------------------------------------------------------------------ the component
BLX = (ax.BATCH, ax.LENGTH, ax.EXPERT)
BLEC = (ax.BATCH, ax.LENGTH, ax.EXPERT, ax.CAPACITY)  # dispatch and combine masks
ECD = (ax.EXPERT, ax.BATCH, ax.CAPACITY, ax.EMBED)  # expert buffers
ECF = (ax.EXPERT, ax.BATCH, ax.CAPACITY, ax.MLP)


def _apply(block, h, segment_ids):
    """The routed experts, plus the shared expert: a dense MLP (``mlp_type``'s) every token goes
    through, scaled by ``sigmoid(h . w)`` per token with ``shared_expert_gate`` (Qwen2-MoE)."""
    config, a = block.config, block.config.arch
    token_mask = None if segment_ids is None else segment_ids > 0  # 0: padding
    out = MoeMLP(config.moe_config(), block.placement, name="moe")(h, block.deterministic, token_mask)
    if not a.shared_expert_intermediate_size:
        return out
    shared = MLP(config, block.placement, a.shared_expert_intermediate_size, name="shared_expert")(h)
    if a.shared_expert_gate:
        gate = Linear((), (ax.EMBED,), name="shared_expert_gate", **linear_kw(config))(h)  # [batch, length]
        shared = shared * jax.nn.sigmoid(gate)[..., None].astype(shared.dtype)
    return out + shared  # [batch, length, embed]


def _params(a, active: bool) -> tuple[int, int]:
    """(the router, the experts (``active``: the top-k) and the shared expert; the router's and
    experts' biases, the correction bias of softmax_bias (a parameter in transformers; sigmoid_groups':
    a buffer), the shared expert's biases)."""
    d, e = a.hidden_size, a.num_local_experts
    shared, shared_bias = mlp_params(a, a.shared_expert_intermediate_size)
    per_expert = (3 if a.expert_type == "gated" else 2) * d * a.expert_size  # gate (gated), up, down
    matmul = d * e + (a.num_experts_per_tok if active else e) * per_expert + shared + d * a.shared_expert_gate
    other = e * (a.router_bias + a.expert_bias * (2 * a.expert_size + d) + (a.router_kind == "softmax_bias"))
    return matmul, other + (shared_bias if a.shared_expert_intermediate_size else 0)


def _activations(cost) -> dict:
    """The router's float32 softmax and z-loss exp; the one-hot dispatch and combine masks of the
    einsum dispatches (the indexed one keeps a few int32 slot indices per token: not counted);
    the expert buffers in and out; the experts' projections and hidden arrays (gated: gate and up,
    silu's residuals and their product; plain: up and the activation's output); the clamped
    SwiGLU's three more; the shared expert's (models/costs.py's doc)."""
    config, t, length = cost.config, cost.t, cost.seq_len
    a, e = config.arch, config.execution
    experts, d, fe, gated = a.num_local_experts, a.hidden_size, a.expert_size, a.expert_type == "gated"
    slots = experts * config.moe_config().capacity(length)  # E*C per row, per token: / L
    out = {"router_logits": t(experts, BLX, 4), "router": t(2 * experts, BLX, 4),
           "masks": t(2 * slots, BLEC) if e.moe_dispatch in ("capacity", "shard_map") else 0,
           "expert_in": t(slots * d / length, ECD), "expert_out": t(slots * d / length, ECD),
           "expert_proj": t((2 if gated else 1) * slots * fe / length, ECF),
           "expert_hidden": t((4 if gated else 1) * slots * fe / length, ECF)}
    if a.swiglu_limit:  # the clamped SwiGLU's min and clip outputs and sigmoid(alpha g)
        out["expert_clamp"] = t(3 * slots * fe / length, ECF)
    fs = a.shared_expert_intermediate_size
    if fs:  # a dense MLP's terms at its width (its gate: 1 per token)
        out.update(shared_up=t(fs, BLF), shared_hidden=t(fs, BLF))
        if a.mlp_type == "gated":
            out.update(shared_gate=t(fs, BLF), shared_proj=t(fs, BLF) if e.fuse_projections else 0)
    return out


MLP_KIND = Mlp(MOE, _apply, _params, _activations)
