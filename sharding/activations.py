"""How many devices share an array: what a model's activation estimate divides by.

The estimate itself belongs to the model (``models/costs.py``, through each config's
``activation_estimate``); the plan hands the model ``shards`` bound to its rules and mesh.
"""

from __future__ import annotations

import math

from shardzoo.sharding.validate import match_dims, mesh_sizes


def shards(names, rules, mesh) -> int:
    """How many devices split an array with these logical names (divisibility ignored)."""
    sizes = mesh_sizes(mesh)
    return math.prod(sizes.get(a, 1) for d in match_dims(names, rules) for a in d.mesh_axes)
