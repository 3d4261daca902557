"""The one place where logical axes meet a mesh: one resolver, and the explicit ``Placement``.

``resolve(names, rules)`` runs flax's first-match loop (``validate.match_dims``) for one array's
logical names; every sharding of shardzoo comes from it: parameters and optimizer state
(``validate.Report.shardings``), activations (``Placement.constrain``), batches
(``spec_to_sharding``) and decoding caches. flax's own resolver is never consulted.

A ``Placement`` is a mesh and a rule table handed explicitly to a model (``config.build(
placement)``): its activation constraints and its explicit ``shard_map`` paths (ring
attention, MoE dispatch, the pipeline) ask it which mesh axes hold a logical name. Without a
placement a model runs on one device with no constraints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from shardzoo.sharding import axes as ax
from shardzoo.sharding.rules import CONTEXT_AXES, Rules
from shardzoo.sharding.validate import match_dims, mesh_sizes, usable_rules


def _entry(mesh_axes: tuple[str, ...]):
    return None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes


def resolve(names, rules) -> PartitionSpec:
    """The PartitionSpec of an array with logical ``names`` (None: an unnamed dimension)."""
    return PartitionSpec(*(_entry(d.mesh_axes) for d in match_dims(tuple(names), rules)))


def spec_to_sharding(names, mesh, rules) -> NamedSharding:
    """One array's logical names to a NamedSharding on ``mesh`` (batches, caches)."""
    return NamedSharding(mesh, resolve(names, usable_rules(rules, mesh)))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def activate(mesh):
    """Set ``mesh`` as jax's current mesh while tracing (an ``AbstractMesh`` too, for planning
    without devices). Rules are never set in a context: they travel in a ``Placement``."""
    if isinstance(mesh, AbstractMesh):
        with jax.sharding.use_abstract_mesh(mesh):
            yield
    else:
        with jax.set_mesh(mesh):
            yield


def mesh_axes_of(logical_name: str, rules, mesh=None, within=None) -> tuple[str, ...]:
    """The mesh axes a logical name maps to when alone in an array (empty when replicated), or
    in an array named ``within`` (the rules' first match over the whole array).

    With ``mesh``, axes of size 1 are dropped."""
    within = (logical_name,) if within is None else tuple(within)
    names = match_dims(within, rules)[within.index(logical_name)].mesh_axes
    if mesh is not None:
        sizes = mesh_sizes(mesh)
        names = tuple(n for n in names if sizes.get(n, 1) > 1)
    return names


def context_axes(rules, mesh) -> tuple[str, ...]:
    """The mesh axes (size > 1) of the activations' ``length`` when they make a context-parallel
    ring (one of them is a context axis, ``rules.CONTEXT_AXES``); empty otherwise.

    ``length`` over ``sequence`` alone (``sp``) is left to XLA."""
    names = mesh_axes_of(ax.LENGTH, rules, mesh)
    return names if any(n in CONTEXT_AXES for n in names) else ()


@dataclasses.dataclass(frozen=True)
class Placement:
    """A mesh and the rule table that maps logical names onto it, given to a model explicitly.

    ``rules`` may name mesh axes the mesh lacks (the validator reports them); they are
    dropped here, so applying a placement never fails on them."""

    mesh: object  # jax.sharding.Mesh or AbstractMesh
    rules: Rules

    def __post_init__(self):
        object.__setattr__(self, "rules", usable_rules(self.rules, self.mesh))

    @property
    def sizes(self) -> dict[str, int]:
        return mesh_sizes(self.mesh)

    def spec(self, names) -> PartitionSpec:
        return resolve(names, self.rules)

    def sharding(self, names) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names))

    def mesh_axes(self, logical_name: str, within=None) -> tuple[str, ...]:
        """The mesh axes of size > 1 that hold ``logical_name`` alone in an array, or in an array
        named ``within``."""
        return mesh_axes_of(logical_name, self.rules, self.mesh, within)

    def size(self, mesh_axes) -> int:
        return math.prod(self.sizes[a] for a in mesh_axes)

    @property
    def ring_axes(self) -> tuple[str, ...]:
        """The context-parallel ring (empty: none)."""
        return context_axes(self.rules, self.mesh)

    def constrain(self, x, names):
        """``x`` constrained to the sharding its logical ``names`` resolve to."""
        return jax.lax.with_sharding_constraint(x, self.sharding(names))


def logical_shardings(boxed_tree, mesh, rules):
    """NamedShardings of every leaf of a boxed abstract tree (``jax.eval_shape(init)``), by its
    logical names under ``rules``: the one resolver, without validation (``validate.check``
    validates)."""
    from flax import linen as nn

    rules = usable_rules(rules, mesh)

    def one(leaf):
        names = tuple(leaf.names) if isinstance(leaf, nn.Partitioned) else (None,) * leaf.ndim
        return NamedSharding(mesh, resolve(names, rules))

    return jax.tree.map(one, boxed_tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))
