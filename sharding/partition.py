"""The one place where logical axes meet a mesh: shardings from (abstract tree, mesh, rules)."""

from __future__ import annotations

import contextlib

import jax
from flax import linen as nn
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from shardzoo.sharding import axes as ax
from shardzoo.sharding.rules import CONTEXT_AXES


def logical_specs(abstract_tree):
    """Logical PartitionSpecs of a tree of (possibly boxed) abstract arrays."""
    return nn.get_partition_spec(abstract_tree)


def logical_shardings(abstract_tree, mesh, rules):
    """NamedShardings for every leaf of a boxed tree (from ``jax.eval_shape(init)``)."""
    return nn.logical_to_mesh_sharding(logical_specs(abstract_tree), mesh, tuple(rules))


def spec_to_sharding(logical_spec, mesh, rules) -> NamedSharding:
    """One logical PartitionSpec (or tuple of names) to a NamedSharding."""
    return NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(logical_spec), tuple(rules)))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def activate(mesh, rules):
    """Set ``mesh`` and ``rules`` for tracing, so models' logical constraints take effect.

    An ``AbstractMesh`` (planning without devices) is set with ``use_abstract_mesh``, since
    ``jax.set_mesh`` accepts only a concrete mesh.
    """
    if isinstance(mesh, AbstractMesh):
        mesh_context = jax.sharding.use_abstract_mesh(mesh)
    else:
        mesh_context = jax.set_mesh(mesh)
    with mesh_context, nn.logical_axis_rules(tuple(rules)):
        yield


def mesh_axes_of(logical_name: str, rules, mesh=None) -> tuple[str, ...]:
    """The mesh axes a logical name maps to when alone in an array (empty when replicated).

    With ``mesh``, axes of size 1 are dropped. Used by the explicit ``shard_map`` paths (MoE, ring attention).
    """
    (assigned,) = nn.logical_to_mesh_axes((logical_name,), tuple(rules))
    names = () if assigned is None else ((assigned,) if isinstance(assigned, str) else tuple(assigned))
    if mesh is not None:
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        names = tuple(n for n in names if sizes.get(n, 1) > 1)
    return names


def context_axes(rules, mesh) -> tuple[str, ...]:
    """The mesh axes (size > 1) of the activations' ``length`` when they make a context-parallel
    ring (one of them is a context axis, ``rules.CONTEXT_AXES``); empty otherwise.

    Used by ring attention; ``length`` over ``sequence`` alone (``sp``) is left to XLA.
    """
    names = mesh_axes_of(ax.LENGTH, rules, mesh)
    return names if any(n in CONTEXT_AXES for n in names) else ()
