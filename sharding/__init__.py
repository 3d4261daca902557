"""Logical axis names, rule tables, meshes, validation and sharding plans."""

from shardzoo.sharding import axes
from shardzoo.sharding.mesh import (
    MeshError,
    describe_mesh,
    make_abstract_mesh,
    make_mesh,
    mesh_shape,
    parse_mesh_spec,
    resolve_mesh_shape,
)
from shardzoo.sharding.plan import Plan, make_plan, parse_device_memory, planning_mesh
from shardzoo.sharding.rules import (
    MESH_AXES,
    PRESETS,
    RuleError,
    Rules,
    format_rules,
    get_rules,
    list_presets,
)
from shardzoo.sharding.validate import (
    ShardingValidationError,
    ShardingValidationWarning,
    check,
    match_dims,
)

__all__ = [
    "MESH_AXES",
    "PRESETS",
    "MeshError",
    "Plan",
    "RuleError",
    "Rules",
    "ShardingValidationError",
    "ShardingValidationWarning",
    "axes",
    "check",
    "describe_mesh",
    "format_rules",
    "get_rules",
    "list_presets",
    "make_abstract_mesh",
    "make_mesh",
    "match_dims",
    "mesh_shape",
    "parse_device_memory",
    "parse_mesh_spec",
    "make_plan",
    "planning_mesh",
    "resolve_mesh_shape",
]
