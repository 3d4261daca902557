"""Pipeline parallelism: the scanned layer stack split into stages, microbatches on a circular
schedule (after MaxText's circular pipeline; written for the zoo's stacked ``[layers, ...]`` tree).

The pipeline runs when the model's placement puts the logical axis ``layers`` on mesh axes of
total size S > 1 (preset ``pp``: ``[layers, stage]``). The parameters keep the scanned model's tree and
layer order (``[layers, ...]``, contiguous blocks of layers per device), so checkpoints, Hugging
Face import/export and the other rule tables see the same model. Inside the step each stacked
parameter is viewed as ``[repeats, stages, layers_per_stage, ...]``: layer
``j = (r * S + s) * layers_per_stage + k`` runs on stage ``s`` in repeat ``r``. With one repeat
that view is exactly the stored layout; with R > 1 it interleaves, and XLA moves (R - 1) / R of
each stage's layers to their stage once per step (and their gradients back).

Schedule: the batch is split into M microbatches (rows m, m + M, ...). Item ``i`` is microbatch
``i % M`` in repeat ``i // M``; at iteration ``t`` stage ``s`` runs its layers of item ``t - s``
(idle, on stale values that are never used, when that item does not exist). The stage function
is ``vmap``-ed over stages with ``spmd_axis_name`` (each device runs its own stage) and every
iteration is rematerialized; activations move to the next stage with ``jnp.roll`` over the
stage-sharded array, which XLA lowers to a collective-permute. The last stage's output wraps
around to stage 0, which keeps it per microbatch (``circ``) until that microbatch's next repeat
(so a circular schedule needs M >= S when R > 1). ``R * M + S - 1`` iterations of which each
stage is busy ``R * M``: the bubble is ``(S - 1) / (R * M + S - 1)``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardzoo.models import ModelError
from shardzoo.models.layers import constrain as _constrain
from shardzoo.sharding import axes as ax

SBLE = (ax.LAYERS, ax.BATCH, ax.LENGTH, ax.EMBED)  # one microbatch per stage


class PipelineError(ModelError):
    """A depth, batch or schedule the pipeline's stages and microbatches cannot split."""


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A circular pipeline's shape: S stages, R repeats, M microbatches over a stack of layers."""

    stages: int
    repeats: int
    microbatches: int
    layers_per_stage: int  # in one repeat
    axes: tuple[str, ...] = ()  # the mesh axes of the stages

    @property
    def iterations(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """Share of a stage's iterations spent idle: (S - 1) / (R x M + S - 1)."""
        return (self.stages - 1) / self.iterations

    def to_dict(self) -> dict:
        return {"stages": self.stages, "repeats": self.repeats, "microbatches": self.microbatches,
                "layers_per_stage": self.layers_per_stage, "iterations": self.iterations,
                "bubble_fraction": self.bubble_fraction}

    def describe(self) -> str:
        s, r, m = self.stages, self.repeats, self.microbatches
        return (f"pipeline: {s} stages x {self.layers_per_stage} layers per repeat, {r} repeats, "
                f"{m} microbatches: {self.iterations} iterations, bubble (S-1)/(RxM+S-1) = "
                f"{s - 1}/{self.iterations} = {100 * self.bubble_fraction:.1f}%")


def make_schedule(num_layers: int, batch_size: int, *, stages: int, microbatches: int, repeats: int,
                  batch_shards: int = 1, axes: tuple[str, ...] = ()) -> PipelineSchedule:
    """The schedule of ``num_layers`` stacked layers on ``stages`` stages, checked.

    ``microbatches`` 0 means one per stage; ``batch_shards``: devices the batch's rows are split
    over inside a stage (every microbatch is split the same way).
    """
    where = f" (rules put layers on mesh axes {','.join(axes)})" if axes else ""
    if repeats < 1 or microbatches < 0:
        raise PipelineError(f"pipeline_repeats={repeats} must be >= 1 and pipeline_microbatches="
                            f"{microbatches} >= 0 (0: one per stage)")
    m = microbatches or stages
    if num_layers % (stages * repeats):
        raise PipelineError(f"num_hidden_layers={num_layers} is not divisible by {stages} pipeline stages"
                            f" x pipeline_repeats={repeats}{where}")
    if batch_size % m:
        raise PipelineError(f"batch of {batch_size} rows is not divisible by pipeline_microbatches={m}")
    if (batch_size // m) % batch_shards:
        raise PipelineError(f"pipeline microbatch of {batch_size // m} rows (batch {batch_size} / "
                            f"pipeline_microbatches={m}) is not divisible by the {batch_shards} devices "
                            "the rules split the batch over")
    if repeats > 1 and m < stages:
        raise PipelineError(f"pipeline_microbatches={m} must be at least the {stages} pipeline stages "
                            f"when pipeline_repeats={repeats} > 1 (the circular schedule)")
    return PipelineSchedule(stages, repeats, m, num_layers // (stages * repeats), tuple(axes))


def placement_schedule(placement, num_layers: int, batch_size: int, *, microbatches: int, repeats: int):
    """The schedule ``placement`` asks for, or None when it puts ``layers`` on no mesh axis of
    size > 1 (no pipeline)."""
    if placement is None:
        return None
    axes = placement.mesh_axes(ax.LAYERS)
    stages = placement.size(axes)
    if stages == 1:
        return None
    batch_shards = math.prod(placement.sizes[a] for a in placement.mesh_axes(ax.BATCH) if a not in axes)
    return make_schedule(num_layers, batch_size, stages=stages, microbatches=microbatches,
                         repeats=repeats, batch_shards=batch_shards, axes=axes)


def _split(a, m: int):
    """``[batch, ...]`` -> ``[m, batch/m, ...]``; microbatch j holds rows j, j + m, ... (each
    device's rows of every microbatch stay on it)."""
    return jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1)


def _by_stage(w, sched: PipelineSchedule, mesh):
    """A stacked parameter ``[layers, ...]`` viewed as ``[repeats, stages, layers_per_stage, ...]``,
    the stage dimension on the stage axes (the other dimensions keep their sharding)."""
    w = w.reshape(sched.repeats, sched.stages, sched.layers_per_stage, *w.shape[1:])
    spec = P(None, sched.axes, None, *([P.UNCONSTRAINED] * (w.ndim - 3)))
    return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec))


def pipeline(sched: PipelineSchedule, placement, layer_fn, params, x, positions, segment_ids):
    """Run ``layer_fn(layer_params, x, positions, segment_ids) -> x`` for every layer of the
    stacked ``params`` (leaves ``[layers, ...]``) on ``x`` [batch, length, embed], pipelined
    over the stages ``placement`` gives the layer stack."""
    s_, r_, m_ = sched.stages, sched.repeats, sched.microbatches

    def constrain(x, names):
        return _constrain(x, names, placement)

    inputs = constrain(_split(x, m_), (None,) + SBLE[1:])  # [microbatch, batch/M, length, embed]
    pos = _split(positions, m_)
    seg = None if segment_ids is None else _split(segment_ids, m_)
    weights = jax.tree.map(lambda w: _by_stage(w, sched, placement.mesh), params)  # [repeats, stages, layers, ...]
    stage_ids = jnp.arange(s_)

    def stage(w, h, s, t):  # one stage's layers on its item: w [repeats, layers, ...], h [batch/M, ...]
        i = t - s
        m, r = i % m_, jnp.clip(i // m_, 0, r_ - 1)
        p, sg = pos[m], None if seg is None else seg[m]

        def body(h, wl):
            return layer_fn(wl, h, p, sg), None

        h, _ = jax.lax.scan(body, h, jax.tree.map(lambda a: a[r], w))
        return h

    def compute(weights, h, t):  # every stage at once, each on its own devices
        return jax.vmap(stage, in_axes=(1, 0, 0, None), spmd_axis_name=sched.axes)(weights, h, stage_ids, t)

    compute = jax.checkpoint(compute, prevent_cse=False, policy=jax.checkpoint_policies.nothing_saveable)

    def shift(state, circ, t):
        """Each stage's output to the next stage; the last stage's (item t - S) to stage 0's store."""
        rolled = constrain(jnp.roll(state, 1, axis=0), SBLE)  # a collective-permute over the stages
        i = t - s_
        m = i % m_
        keep = jax.lax.dynamic_index_in_dim(circ, m, axis=1, keepdims=False)
        circ = jax.lax.dynamic_update_index_in_dim(circ, jnp.where(i >= 0, rolled, keep), m, axis=1)
        return rolled, circ

    def iteration(carry, t):
        state, circ = carry
        rolled, circ = shift(state, circ, t)
        m = t % m_  # stage 0 starts item t: microbatch m, from the inputs in repeat 0, else from circ
        first = jnp.where(t < m_, inputs[m][None], jax.lax.dynamic_index_in_dim(circ, m, 1, False))
        h = constrain(jnp.where((stage_ids == 0)[:, None, None, None], first, rolled), SBLE)
        return (constrain(compute(weights, h, t), SBLE), circ), None

    state = constrain(jnp.zeros((s_,) + inputs.shape[1:], x.dtype), SBLE)
    circ = constrain(jnp.zeros((s_,) + inputs.shape, x.dtype), (ax.LAYERS,) + (None,) + SBLE[1:])
    (state, circ), _ = jax.lax.scan(iteration, (state, circ), jnp.arange(sched.iterations))
    _, circ = shift(state, circ, sched.iterations)
    out = circ[0]  # stage 0 holds every microbatch's last output: [microbatch, batch/M, length, embed]
    return jnp.swapaxes(out, 0, 1).reshape(x.shape)
