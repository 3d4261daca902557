"""Mixture of attention heads (MoA: JetMoE), a token mixer on ``moa`` layers.

Per token a router picks ``num_experts_per_tok`` (k) of ``num_experts`` experts, each a pair of
a query projection [embed -> kv_heads x head_dim] and an output projection back; the keys and
values are one projection shared by every expert. Each chosen expert's query heads attend the
shared key/value heads, so the attention has ``kv_heads x k`` query heads over ``kv_heads``
key/value heads (``num_attention_heads``), which ``Attention`` runs as grouped-query attention
with its rotary embeddings, masks, kernels, context parallelism and decoding cache. The outputs
of the k experts' output projections are summed, weighted by the router, plus one bias.

The router and its losses are the MoE layer's (``models/moe_routing.py``: JetMoE's top-k
softmax is ``router_kind`` softmax with ``norm_topk_prob``); the tokens reach the experts as a
MoE layer's do (``models/moe_dispatch.py``, by ``execution.moe_dispatch``): ``dropless`` and
``gmm`` sort the assignments through one grouped matmul (``grouped_linear``, jax's
``ragged_dot``); the others fill the experts' capacity buffers by index (``indexed_slots``),
whose ``expert`` axis the ``ep`` rules put on the expert mesh axis. Both projections of a token's
assignment use the same slot, so an assignment dropped over capacity drops out whole.

Sown per call: ``losses/moa_aux_loss`` (aux_loss_coef x load balance + the execution's z-loss
coefficient x z-loss), ``metrics/{moa_load_balance_loss, moa_router_z_loss, moa_dropped_fraction}``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp
from flax import linen as nn

from shardzoo.models import ModelError, check_fields
from shardzoo.models import attention_costs as costs
from shardzoo.models.attention import CONTEXT_PARALLEL, Attention
from shardzoo.models.component import Mixer, SubRecord
from shardzoo.models.layers import dtype_of
from shardzoo.models.moe_dispatch import (
    expert_capacity,
    from_buffers,
    grouped_linear,
    indexed_slots,
    resolve_dispatch,
    to_buffers,
)
from shardzoo.models.moe_routing import choose_experts, router_losses
from shardzoo.sharding import axes as ax

MOA = "moa"  # its name in layer_types, and the mixer's


@dataclasses.dataclass(frozen=True)
class MoaArch(SubRecord):
    """The MoA layers' experts: ``num_experts_per_tok`` of ``num_experts`` query/output projection
    pairs per token; the router's load-balancing loss weighted by ``aux_loss_coef``."""

    NAME: ClassVar[str] = "moa"
    FEATURE: ClassVar[str] = "mixture_of_attention"
    OWNERS: ClassVar[tuple[str, ...]] = (MOA,)
    FLAT: ClassVar[dict[str, str]] = {"moa_num_experts": "num_experts",
                                      "moa_num_experts_per_tok": "num_experts_per_tok",
                                      "moa_aux_loss_coef": "aux_loss_coef"}
    # how ``choose_experts`` reads it: the softmax's top k, renormalised (JetMoE's softmax of the top-k logits)
    router_kind: ClassVar[str] = "softmax"
    norm_topk_prob: ClassVar[bool] = True
    routed_scaling_factor: ClassVar[float] = 1.0

    num_experts: int = 8
    num_experts_per_tok: int = 2
    aux_loss_coef: float = 0.01

    def check(self, arch) -> None:
        check_fields(self, {}, ("num_experts", "num_experts_per_tok"))
        e, k = self.num_experts, self.num_experts_per_tok
        if k > e:
            raise ModelError(f"moa num_experts_per_tok={k} must be in 1..num_experts={e}")
        if not (math.isfinite(self.aux_loss_coef) and self.aux_loss_coef >= 0):
            raise ModelError(f"moa aux_loss_coef={self.aux_loss_coef!r} must be a finite number >= 0")
        if arch.num_attention_heads != arch.kv_heads * k:
            raise ModelError(f"moa layers attend with the key/value heads' count of query heads per chosen expert: "
                             f"num_attention_heads={arch.num_attention_heads} must be num_key_value_heads="
                             f"{arch.kv_heads} x moa num_experts_per_tok={k}")
        other = [n for n in ("latent", "attention_bias", "attention_out_bias", "attn_output_gate", "attn_head_gate",
                             "diff_attention", "sub_norms", "global_attention") if getattr(arch, n)]
        if other:
            raise ModelError(f"moa layers (mixture of attention heads) have their own projections and output bias: "
                             f"{', '.join(other)} cannot be set beside them")


class MixtureOfAttention(Attention):
    """``Attention`` whose query and output projections are the router's chosen experts."""

    def _weights(self, name, shape, names):
        e = self.config.execution
        init = nn.initializers.normal(self.config.arch.initializer_range)
        w = self.param(name, nn.with_logical_partitioning(init, names), shape, dtype_of(e.param_dtype))
        return w.astype(dtype_of(e.dtype))

    def route(self, x, segment_ids):
        """(weights [batch, length, k], experts [batch, length, k], the indexed dispatch's
        (source, slot), or None where the dispatch is dropless), its losses sown."""
        a, e = self.config.arch, self.config.execution
        m, length = a.moa, x.shape[1]
        logits = nn.Dense(m.num_experts, use_bias=False, dtype=jnp.float32, param_dtype=dtype_of(e.param_dtype),
                          kernel_init=nn.with_logical_partitioning(nn.initializers.normal(a.initializer_range),
                                                                   (ax.EMBED, ax.EXPERT)),
                          name="router")(x.astype(jnp.float32))  # [batch, length, expert]
        probs, top_p, top_idx = choose_experts(logits, m)
        token_mask = None if segment_ids is None else segment_ids > 0  # 0: padding
        load_balance, z_loss = router_losses(logits, probs, top_idx, token_mask)
        slots, dropped = None, jnp.zeros((), jnp.float32)
        if resolve_dispatch(e.moe_dispatch, self.placement, e.dtype) not in ("dropless", "gmm"):
            capacity = expert_capacity(e.capacity_factor, length, m.num_experts_per_tok, m.num_experts)
            source, slot, dropped = indexed_slots(top_idx, m.num_experts, capacity, token_mask, by_assignment=True)
            slots = (source, slot)
        self.sow("losses", "moa_aux_loss", m.aux_loss_coef * load_balance + e.router_z_loss_coef * z_loss)
        self.sow("metrics", "moa_load_balance_loss", load_balance)
        self.sow("metrics", "moa_router_z_loss", z_loss)
        self.sow("metrics", "moa_dropped_fraction", dropped)
        return top_p, top_idx, slots

    def _project(self, rows, w, route, in_axis, out_axis):
        """Each assignment through its expert: ``rows`` [batch, length, in] (a token's row for
        each of its k assignments) or [batch, length, k, in], ``w`` [expert, in, out] ->
        [batch, length, k, out] (an assignment dropped over capacity: 0)."""
        _, top_idx, slots = route
        b, length, k = top_idx.shape
        per_token = rows.ndim == 3
        if slots is None:  # dropless: the assignments in (token, choice) order, sorted by expert
            flat = rows.reshape(b * length, 1 if per_token else k, -1)
            flat = jnp.broadcast_to(flat, (b * length, k, flat.shape[-1])).reshape(b * length * k, -1)
            return grouped_linear(flat, top_idx.reshape(-1), w).reshape(b, length, k, -1)
        source, slot = slots
        if per_token:  # the token of each slot's assignment (an empty slot's length * k: token length, 0)
            source = source // k
        else:
            rows = rows.reshape(b, length * k, -1)
        xe = to_buffers(rows, source, w.shape[0], self.placement, in_axis)  # [expert, batch, capacity, in]
        return from_buffers(jnp.einsum("ebci,eio->ebco", xe, w), slot, self.placement, out_axis)

    def query(self, x, route):
        """The chosen experts' queries, grouped by key/value head: [batch, length, kv_heads x k, head_dim]."""
        a = self.config.arch
        e, d, h, hd = a.moa.num_experts, a.hidden_size, a.kv_heads, a.head_size
        wq = self._weights("q_experts", (e, d, h, hd), (ax.EXPERT, ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM))
        q = self._project(x, wq.reshape(e, d, h * hd), route, ax.EMBED, None)  # [batch, length, k, heads x head_dim]
        b, length, k = q.shape[:3]
        q = q.reshape(b, length, k, h, hd).transpose(0, 1, 3, 2, 4)  # [batch, length, kv_heads, k, head_dim]
        return q.reshape(b, length, h * k, hd)

    def output(self, ctx, route):
        """Each chosen expert's output projection of its heads, weighted by the router, summed, plus the bias."""
        a = self.config.arch
        e, d, h, hd = a.moa.num_experts, a.hidden_size, a.kv_heads, a.head_size
        top_p = route[0]
        b, length, k = top_p.shape
        ctx = ctx.reshape(b, length, h, k, hd).transpose(0, 1, 3, 2, 4).reshape(b, length, k, h * hd)
        wo = self._weights("o_experts", (e, h, hd, d), (ax.EXPERT, ax.KV_HEADS, ax.HEAD_DIM, ax.EMBED))
        out = self._project(ctx, wo.reshape(e, h * hd, d), route, None, ax.EMBED)  # [batch, length, k, embed]
        out = jnp.einsum("blkd,blk->bld", out, top_p.astype(out.dtype))
        bias = self.param("o_bias", nn.with_logical_partitioning(nn.initializers.zeros, (ax.EMBED,)), (d,),
                          dtype_of(self.config.execution.param_dtype))
        return out + bias.astype(out.dtype)


# ------------------------------------------------------------------------------ the component
def _apply(block, h, positions, segment_ids):
    return MixtureOfAttention(block.config, block.spec, block.placement, name="attn")(
        h, positions, segment_ids, block.decode)


def _params(a) -> tuple[int, int]:
    """Attention's of kv_heads x k query heads (the k chosen experts' q and o, the shared k and v,
    any qk-norm), the router; the output bias."""
    matmul, other = costs.params(a)
    return matmul + a.hidden_size * a.moa.num_experts, other + a.hidden_size


def _idle_params(a) -> int:
    """The experts a token does not choose: their q and o projections."""
    return 2 * (a.moa.num_experts - a.moa.num_experts_per_tok) * a.hidden_size * a.kv_heads * a.head_size


def _activations(cost, spec=None) -> dict:
    """Attention's, and the router's float32 logits and softmax (``models/moe.py``'s terms)."""
    e = cost.config.arch.moa.num_experts
    blx = (ax.BATCH, ax.LENGTH, ax.EXPERT)
    return costs.activations(cost, spec) | {"moa_router_logits": cost.t(e, blx, 4), "moa_router": cost.t(2 * e, blx, 4)}


MIXER = Mixer(MOA, (MOA,), _apply, _params, costs.flops, costs.decode_flops, _activations, costs.model_terms,
              costs.cache_bytes, CONTEXT_PARALLEL, records=(MoaArch,), idle_params=_idle_params)
