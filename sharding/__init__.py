"""Logical axis names, rule tables, meshes, validation and sharding plans."""

from shardzoo.sharding import axes
from shardzoo.sharding.errors import UserError
from shardzoo.sharding.mesh import (
    MeshError,
    describe_mesh,
    make_abstract_mesh,
    make_mesh,
    mesh_shape,
    parse_mesh_spec,
    resolve_mesh_shape,
)
from shardzoo.sharding.rules import (
    MESH_AXES,
    PRESETS,
    RuleError,
    Rules,
    format_rules,
    get_rules,
    list_presets,
)

__all__ = [
    "MESH_AXES",
    "PRESETS",
    "MeshError",
    "RuleError",
    "Rules",
    "UserError",
    "axes",
    "describe_mesh",
    "format_rules",
    "get_rules",
    "list_presets",
    "make_abstract_mesh",
    "make_mesh",
    "mesh_shape",
    "parse_mesh_spec",
    "resolve_mesh_shape",
]
