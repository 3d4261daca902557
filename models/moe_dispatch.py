"""How a MoE layer sends its tokens to the experts and back, chosen by ``MoeConfig.dispatch``:

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

The mixture of attention heads (``models/moa.py``) sends each token's assignments through single
projections with the same pieces: ``indexed_slots`` with ``to_buffers`` and ``from_buffers``, or
the dropless ``grouped_linear``.

Groups and priority (``indexed``, ``capacity`` and ``shard_map``): a group is one batch row.
Each expert takes at most ``capacity = min(length, ceil(capacity_factor * length * k /
num_experts))`` assignments per row, filled in GShard/Switch priority: every token's top-1 choice in token
order, then every top-2 choice in token order, and so on. A dropped assignment contributes 0
to the layer's output; the block's residual add carries the token on.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import einops
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from shardzoo.models import ModelError
from shardzoo.models.layers import constrain
from shardzoo.sharding import axes as ax

DISPATCHES = ("indexed", "capacity", "dropless", "gmm", "shard_map", "auto")
GMM_DTYPES = ("float32", "bfloat16")  # what megablox multiplies


class MoeError(ModelError):
    """A MoE setting the user gave cannot be honoured (a config value, the rules or the mesh)."""


class ExpertAxisError(MoeError):
    """``dispatch="shard_map"`` but the placement puts ``expert`` on no mesh axis of size > 1."""


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



def expert_capacity(capacity_factor: float, group_size: int, k: int, num_experts: int) -> int:
    """Slots per expert in a group of ``group_size`` tokens choosing ``k`` experts each (never more than the group)."""
    return max(1, min(group_size, math.ceil(capacity_factor * group_size * k / num_experts)))


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


def _named(gate, up):
    """The experts' gate and up projections under the dense MLP's checkpoint names, so that
    save_qkv_mlp keeps them in MoE layers too (the backward then reruns no expert matmul)."""
    return None if gate is None else checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")


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
    gate, up = _named(gate, up)
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


def indexed_slots(top_idx, num_experts: int, capacity: int, token_mask=None, by_assignment: bool = False):
    """GShard's slots found by sorting each row's assignments by expert (same priority, drops).

    top_idx [batch, length, k]; token_mask [batch, length] (padding takes no slot). Returns
    ``source`` [batch, expert*capacity]: the token in each slot (``length``, out of range, for
    an empty one; ``by_assignment``: the assignment, ``l * k + j`` of token l's j-th choice, and
    ``length * k`` for an empty one), ``slot`` [batch, length, k]: each assignment's slot
    (``expert*capacity``, out of range, where dropped or not routed), and the fraction of routed
    assignments dropped.
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
    if by_assignment:  # (k l) priority order -> (l k) row order
        source = jnp.where(filled.reshape(b, -1), assignment % length * k + assignment // length, length * k)
    else:
        source = jnp.where(filled.reshape(b, -1), assignment % length, length)  # [batch, expert*capacity]
    rank = jnp.argsort(order, axis=-1)  # each assignment's place in expert order
    within = rank - jnp.take_along_axis(start, jnp.minimum(flat, num_experts - 1), axis=-1)
    kept = (flat < num_experts) & (within < capacity)
    slot = jnp.where(kept, flat * capacity + within, num_experts * capacity)
    routed = b * length if token_mask is None else jnp.maximum(token_mask.sum(), 1)
    dropped = 1.0 - kept.sum() / (routed * k)
    return source, einops.rearrange(slot, "b (k l) -> b l k", k=k), dropped


def to_buffers(x, source, num_experts: int, placement, features: str | None = ax.EMBED):
    """Rows of ``x`` [batch, rows, features] gathered by ``source`` (``indexed_slots``') into the
    experts' capacity buffers [expert, batch, capacity, features] (empty slots 0), filled where
    the rows live and then moved to their experts' owners (XLA's all-to-all under ``ep``)."""
    xe = jnp.take_along_axis(x, source[..., None], axis=1, mode="fill", fill_value=0)
    xe = einops.rearrange(xe, "b (e c) d -> e b c d", e=num_experts)
    xe = constrain(xe, (None, ax.BATCH, ax.CAPACITY, features), placement)
    return constrain(xe, (ax.EXPERT, ax.BATCH, ax.CAPACITY, features), placement)


def from_buffers(ye, slot, placement, features: str | None = ax.EMBED):
    """The experts' buffers [expert, batch, capacity, features] back where their rows live, each
    assignment's row [batch, length, k, features] picked by ``slot`` (dropped: 0)."""
    ye = constrain(ye, (ax.EXPERT, ax.BATCH, ax.CAPACITY, features), placement)
    ye = constrain(ye, (None, ax.BATCH, ax.CAPACITY, features), placement)
    ye = einops.rearrange(ye, "e b c d -> b (e c) d")
    yk = jnp.take_along_axis(ye, einops.rearrange(slot, "b l k -> b (l k)")[..., None], axis=1, mode="fill",
                             fill_value=0)
    return einops.rearrange(yk, "b (l k) d -> b l k d", k=slot.shape[-1])


def indexed_dispatch(x, source, slot, top_p, wi_gate, wi_up, wo, act, placement, biases=None, scale_input=False):
    """Gather tokens into the capacity buffers, run the experts, gather back and weight
    (``scale_input``: weight each slot's input instead, and sum the outputs).

    The buffers and their sharding are ``capacity_dispatch``'s: the rules' ``expert`` axis
    moves them to their experts' owners (XLA's all-to-all under ``ep``).
    """
    num_experts = wo.shape[0]
    xe = to_buffers(x, source, num_experts, placement)  # [expert, batch, capacity, embed]; empty slots 0
    if scale_input:  # each slot's weight: its assignment's (dropped ones fall off the end)
        b = x.shape[0]
        rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], slot.shape)
        w = jnp.zeros((b, source.shape[1]), top_p.dtype).at[rows, slot].set(top_p, mode="drop")
        xe = xe * einops.rearrange(w, "b (e c) -> e b c", e=num_experts)[..., None].astype(xe.dtype)
        top_p = jnp.ones_like(top_p)
    ye = expert_ffn(xe, wi_gate, wi_up, wo, act, placement, biases)
    yk = from_buffers(ye, slot, placement)  # [batch, length, k, embed]; dropped: 0
    return jnp.einsum("blkd,blk->bld", yk, top_p.astype(yk.dtype))  # [batch, length, embed]


def grouped_linear(rows, experts, w, matmul=jax.lax.ragged_dot):
    """``rows`` [n, in] each times its expert's ``w[experts]`` ([expert, in, out]) -> [n, out],
    dropless: the rows sorted by expert through one grouped ``matmul`` and put back in order."""
    order = jnp.argsort(experts, stable=True)
    sizes = jnp.bincount(experts, length=w.shape[0]).astype(jnp.int32)
    return matmul(rows[order], w, sizes)[jnp.argsort(order)]


def whole_groups(act, gated: bool, biases, dtype) -> bool:
    """Whether the experts map a zero row to zero (no biases; silu, relu2, gelu, GPT-OSS's clamped
    SwiGLU: act(0) = 0), so that ``sorted_dispatch`` may compute padding's zero rows in a group.
    Asked outside any ``shard_map`` (it evaluates ``act`` on a constant)."""
    if biases is not None:
        return False
    with jax.ensure_compile_time_eval():
        z = jnp.zeros((1,), dtype)
        return bool(jnp.all(act(z if gated else None, z) == 0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _sorted_rows(x, order, inverse, k):
    """``x[order // k]``: each of ``x [tokens, embed]``'s k assignments, in ``order``; its gradient
    gathers by ``inverse`` (``argsort(order)``) and sums each token's k rows, where autodiff's is
    a scatter-add (slower on a TPU: 3.3 against 3.7 ms at 65,536 x 2,048, bench/tpu_gather.py)."""
    return x[order // k]


def _sorted_rows_fwd(x, order, inverse, k):
    return x[order // k], inverse


def _sorted_rows_bwd(k, inverse, g):
    dx = g[inverse].reshape(-1, k, g.shape[-1]).astype(jnp.float32).sum(1)
    return dx.astype(g.dtype), None, None


_sorted_rows.defvjp(_sorted_rows_fwd, _sorted_rows_bwd)


@jax.custom_vjp
def _permuted(y, perm, inverse):
    """``y[perm]`` for a permutation; its gradient a gather by ``inverse``, not a scatter."""
    return y[perm]


def _permuted_fwd(y, perm, inverse):
    return y[perm], inverse


def _permuted_bwd(inverse, g):
    return g[inverse], None, None


_permuted.defvjp(_permuted_fwd, _permuted_bwd)


def sorted_dispatch(x, top_idx, top_p, wi_gate, wi_up, wo, act, biases=None, scale_input=False, token_mask=None,
                    matmul=jax.lax.ragged_dot, row_multiple=1, whole=None, hidden_matmul=None):
    """Tokens sorted by expert, each expert's rows through ``matmul(rows, weights [expert, in,
    out], group_sizes)``; no capacity, nothing dropped (``scale_input``: each assignment's input
    weighted, the outputs summed).

    Padding (``token_mask`` false) sorts after every expert and gives 0; the rows are padded to a
    multiple of ``row_multiple`` (the kernel's row tile). ``whole`` (None: ``whole_groups``):
    padding's rows join the last expert's group, as zeros, so every row is computed and none
    needs masking; else they stay outside every group (a kernel may leave them unwritten, in the
    forward and the backward) and each is masked where it enters and leaves a matmul. Choices
    of a zero expert (index ``num_experts``, LongCat-Flash's) sort with padding: their callers
    pass ``whole=False``, so they are never computed. ``hidden_matmul`` (None: ``matmul``): the
    gate's and up's, whose output the activation reads before the hidden is cast to ``x``'s dtype.
    """
    b, length, d = x.shape
    k, num_experts = top_idx.shape[-1], wo.shape[0]
    flat = top_idx.reshape(-1)  # [batch*length*k]
    x = x.reshape(-1, d)
    if token_mask is not None:
        flat = jnp.where(jnp.repeat(token_mask.reshape(-1), k), flat, num_experts)
        x = jnp.where(token_mask.reshape(-1, 1), x, 0)  # padding's rows zero (and their gradients)
    n = flat.shape[0]
    pad = -n % row_multiple
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.argsort(order)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [expert]; padding not counted
    expert = jnp.pad(flat[order], (0, pad), constant_values=num_experts)  # [rows]: each sorted row's expert
    valid = (expert < num_experts)[:, None]
    expert = jnp.minimum(expert, num_experts - 1)
    xs = _sorted_rows(x, order, inverse, k)  # [batch*length*k, embed], grouped by expert
    if scale_input:
        xs = xs * top_p.reshape(-1)[order][:, None].astype(xs.dtype)
        top_p = jnp.ones_like(top_p)
    xs = jnp.pad(xs, ((0, pad), (0, 0))) if pad else xs  # [rows, embed]
    whole = whole_groups(act, wi_gate is not None, biases, xs.dtype) if whole is None else whole
    if whole:  # padding's rows in the last group: computed, zero
        sizes = sizes.at[-1].add(n + pad - jnp.sum(sizes))
    else:  # rows outside every group: their gradients too, which the kernel leaves unwritten
        xs = jnp.where(valid, xs, 0)

    def project(h, w, bias, matmul=matmul):  # [rows, in] -> [rows, out], padding's rows 0
        y = matmul(h, w, sizes)
        return y if whole else jnp.where(valid, y if bias is None else y + bias[expert], 0)

    biases = biases or (None,) * 3
    hidden = functools.partial(project, matmul=hidden_matmul or matmul)
    up = hidden(xs, wi_up, biases[1])
    gate, up = _named(None if wi_gate is None else hidden(xs, wi_gate, biases[0]), up)
    ys = project(act(gate, up).astype(xs.dtype), wo, biases[2])[:n]  # [batch*length*k, embed]
    ys = einops.rearrange(_permuted(ys, inverse, order), "(b l k) d -> b l k d", b=b, l=length)  # token order
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


def gmm_matmul(tiling: GmmTiling, interpret: bool, wide: bool = False):
    """``(rows, weights, group_sizes) -> rows @ weights[group]`` by megablox's grouped matmul, in
    the rows' dtype; ``wide``: in float32, the kernel's accumulation unrounded (``_gmm_wide``)."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm  # noqa: I001 - lazily: Pallas only here

    def matmul(lhs, rhs, sizes):
        if wide and lhs.dtype != jnp.float32:
            return _gmm_wide(lhs, rhs, sizes, tiling, interpret)
        return gmm(lhs, rhs, sizes, lhs.dtype, tiling, interpret=interpret)

    return matmul


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm_wide(lhs, rhs, sizes, tiling, interpret):
    """megablox's ``gmm`` with a float32 output from bfloat16 operands. Its backward rounds the
    output's gradient to the operands' dtype and runs megablox's own (``gmm`` against the
    transposed weights, ``tgmm``), as a bfloat16 output's would be: the kernels see one dtype."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm  # noqa: I001 - the kernel, not ops' custom vjp

    return gmm(lhs, rhs, sizes, jnp.float32, tiling, interpret=interpret)


def _gmm_wide_fwd(lhs, rhs, sizes, tiling, interpret):
    return _gmm_wide(lhs, rhs, sizes, tiling, interpret), (lhs, rhs, sizes)


def _gmm_wide_bwd(tiling, interpret, residuals, g):
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm  # noqa: I001

    lhs, rhs, sizes = residuals
    g = g.astype(lhs.dtype)
    grad_lhs = gmm(g, rhs, sizes, lhs.dtype, tiling, transpose_rhs=True, interpret=interpret)
    grad_rhs = tgmm(lhs.swapaxes(0, 1), g, sizes, rhs.dtype, tiling, None, rhs.shape[0], interpret=interpret)
    return grad_lhs, grad_rhs, None


_gmm_wide.defvjp(_gmm_wide_fwd, _gmm_wide_bwd)


def gmm_dispatch(x, top_idx, top_p, wi_gate, wi_up, wo, act, placement, biases=None, scale_input=False,
                 token_mask=None, tiling=None, interpret=None, whole=None, wide_hidden=False):
    """``sorted_dispatch`` by megablox's grouped matmul; on a mesh, inside a ``shard_map`` over the
    mesh axes of the tokens' ``batch`` and ``length`` (where they divide them), every expert's
    weights whole on each device. ``interpret`` None: Pallas' interpret mode off a TPU.
    ``wide_hidden``: the gate and up come out of the kernel in float32, for an activation that
    clamps them (GPT-OSS's): a bfloat16 output moved values across the limit where float32 did
    not, so the gradients of the clamped experts strayed from float32's (on the chip 3.5e-2
    against the indexed dispatch's 4.8e-3, whose fusions keep the matmul's float32 there; on a
    CPU in bfloat16, 2.2e-2 to 1.3e-1 bfloat16 out against 4.2-4.7e-3 float32 out)."""
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    tiling = tiling or GmmTiling(cols=1024 if x.dtype.itemsize < 4 else 512)
    whole = whole_groups(act, wi_gate is not None, biases, x.dtype) if whole is None else whole  # not in shard_map

    def local(x, top_idx, top_p, token_mask, weights, biases):
        matmul = gmm_matmul(tiling, interpret)
        multiple = tiling.row_multiple(top_idx.size)
        hidden = gmm_matmul(tiling, interpret, wide=True) if wide_hidden else None
        return sorted_dispatch(x, top_idx, top_p, *weights, act, biases, scale_input, token_mask, matmul, multiple,
                               whole, hidden)

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
    ``clamped`` (GPT-OSS's clamped SwiGLU): indexed. gmm decides their clamp in float32
    (``gmm_dispatch``'s ``wide_hidden``; its bf16 gate had strayed 7x further from float32 than
    indexed on the chip), and the chip has confirmed its gradients within the other expert
    types' bound (BENCHMARKS.md, TPU); ``auto`` waits for a timing of that wider gate on the
    chip before it takes gmm for them (``moe_dispatch=gmm`` asks for it)."""
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

