"""Meshes from specs like ``"data=2,fsdp=-1,tensor=2"``, always with every standard axis."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from shardzoo.errors import UserError
from shardzoo.sharding.rules import MESH_AXES


class MeshError(UserError):
    """A mesh spec the user gave does not parse or does not fit the devices."""


MAX_DEVICES = 2**31 - 1  # XLA's device ids and counts are int32


def parse_mesh_spec(spec) -> dict[str, int]:
    """``"data=2,fsdp=-1"`` (or a mapping) to an ordered {axis: size}; -1 is resolved later."""
    if isinstance(spec, dict):
        items = list(spec.items())
    else:
        items = []
        for part in (p.strip() for p in str(spec or "").split(",")):
            if not part:
                continue
            name, eq, size = part.partition("=")
            if not eq:
                raise MeshError(f"mesh spec {spec!r}: {part!r} is not AXIS=SIZE")
            try:
                items.append((name.strip(), int(size)))
            except ValueError:
                raise MeshError(f"mesh spec {spec!r}: size of {name.strip()!r} is not an integer: {size!r}") from None
    sizes: dict[str, int] = {}
    for name, size in items:
        if name not in MESH_AXES:
            raise MeshError(f"mesh spec {spec!r}: unknown mesh axis {name!r}; axes are {', '.join(MESH_AXES)}")
        if name in sizes:
            raise MeshError(f"mesh spec {spec!r}: axis {name!r} given twice")
        if size == 0 or size < -1:
            raise MeshError(f"mesh spec {spec!r}: size of {name!r} must be positive or -1, got {size}")
        sizes[name] = size
    if sum(1 for s in sizes.values() if s == -1) > 1:
        raise MeshError(f"mesh spec {spec!r}: at most one axis may be -1")
    total = math.prod(s for s in sizes.values() if s != -1)
    if total > MAX_DEVICES:
        raise MeshError(f"mesh spec {spec!r}: {total} devices in all; a mesh holds at most {MAX_DEVICES} "
                        "(XLA counts devices in 32-bit integers)")
    return sizes


def resolve_mesh_shape(spec, num_devices: int | None) -> dict[str, int]:
    """Sizes for every standard axis (1 when not named), -1 filled from ``num_devices``."""
    sizes = parse_mesh_spec(spec)
    known = math.prod(s for s in sizes.values() if s != -1)
    if -1 in sizes.values():
        if num_devices is None:
            raise MeshError(f"mesh spec {spec!r}: -1 needs a device count")
        if num_devices % known:
            raise MeshError(
                f"mesh spec {spec!r}: {num_devices} devices are not divisible by the fixed axes' product {known}"
            )
        sizes = {k: (num_devices // known if v == -1 else v) for k, v in sizes.items()}
    elif not sizes and num_devices is not None:
        sizes = {MESH_AXES[0]: num_devices}
    total = math.prod(sizes.values())
    if num_devices is not None and total != num_devices:
        shown = ",".join(f"{k}={v}" for k, v in sizes.items()) or "(empty)"
        raise MeshError(f"mesh spec {shown} has {total} devices but {num_devices} are available")
    return {name: sizes.get(name, 1) for name in MESH_AXES}


def make_mesh(spec="", devices=None) -> Mesh:
    """A device mesh over all (or the given) devices, with Auto axis types and every standard axis."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(spec, len(devices))
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if devices == list(jax.devices()):
        return jax.make_mesh(tuple(shape.values()), MESH_AXES, axis_types=axis_types)
    return Mesh(np.array(devices).reshape(tuple(shape.values())), MESH_AXES, axis_types=axis_types)


def make_abstract_mesh(spec, num_devices: int | None = None) -> AbstractMesh:
    """A device-free mesh for planning runs larger than this machine."""
    shape = resolve_mesh_shape(spec, num_devices)
    return AbstractMesh(tuple(shape.values()), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_shape(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def describe_mesh(mesh) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh_shape(mesh).items())
