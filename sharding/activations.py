"""How many devices share an array: what a model's activation estimate divides by.

The estimate itself belongs to the model (``models/costs.py``, through each config's
``activation_estimate``); the plan hands the model ``shards`` bound to its rules and mesh.
"""

from __future__ import annotations

import math

from shardzoo.sharding.partition import context_axes
from shardzoo.sharding.validate import match_dims, mesh_sizes


def shards(names, rules, mesh) -> int:
    """How many devices split an array with these logical names (divisibility ignored)."""
    sizes = mesh_sizes(mesh)
    return math.prod(sizes.get(a, 1) for d in match_dims(names, rules) for a in d.mesh_axes)


class Shards:
    """``shards`` bound to a rule table and a mesh, as the plan hands it to a model's estimate;
    ``ring`` is the context-parallel ring's size (1: none), whose attention saves other arrays."""

    def __init__(self, rules, mesh):
        self.rules, self.mesh = rules, mesh
        sizes = mesh_sizes(mesh)
        self.ring = math.prod(sizes[a] for a in context_axes(rules, mesh))

    def __call__(self, names) -> int:
        return shards(names, self.rules, self.mesh)
