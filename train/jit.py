"""The one jit site (``compile_on``, which ``Program.compile`` calls) and the arrays it places:
global arrays from host data and back, per-device bytes under shardings, and what XLA says a
compiled program costs (memory, collectives)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from shardzoo.sharding.partition import activate

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective op (sync or ``-start`` async form) the HLO text holds."""
    return {op: len(re.findall(rf"\b{op}(-start)?\(", hlo_text)) for op in COLLECTIVES}


def memory_analysis(compiled) -> dict:
    """Per-device bytes from XLA: argument, output, temp, alias and total."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    memory = {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    memory["total"] = memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
    return memory


def per_device_bytes(tree, shardings) -> int:
    """Bytes one device holds of a tree of arrays (or ShapeDtypeStructs) under ``shardings``."""
    leaves = zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
    return sum(jnp.dtype(a.dtype).itemsize * math.prod(s.shard_shape(a.shape)) for a, s in leaves)


def with_shardings(abstract_tree, shardings):
    """ShapeDtypeStructs carrying ``shardings`` (restore targets, lowering arguments)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_tree, shardings)


def _compile(lowered, fast: bool = False, options=None):
    """Compile with XLA ``options`` (per compile, as ``XLA_FLAGS`` would set them); ``fast`` skips
    LLVM's optimizations for a program that runs once (init), which on CPU dominate the compile
    of threefry-heavy init programs (measured 37 s -> 4 s)."""
    options = dict(options or {})
    if fast and jax.default_backend() == "cpu":
        options["xla_backend_optimization_level"] = 0
    return lowered.compile(compiler_options=options) if options else lowered.compile()


def compile_on(mesh, fn, *args, in_shardings=None, out_shardings=None, donate_argnums=(), fast: bool = False,
               options=None):
    """The one jit site (``Program.compile``; module level for the few that place arrays without
    a Program: a checkpoint's relayout, a reference's zero adapters): ``fn`` jitted with these
    shardings, lowered on ``args`` (arrays or ShapeDtypeStructs) under ``mesh``, compiled with
    the compiler ``options``."""
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate_argnums)
    with activate(mesh):
        return _compile(jitted.lower(*args), fast, options)


def zeros_on(shapes, shardings):
    """Zeros of ``shapes`` (a tree of ShapeDtypeStructs), each created sharded by ``shardings``."""
    mesh = jax.tree.leaves(shardings)[0].mesh
    return compile_on(mesh, lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                      out_shardings=shardings)()



def global_array(value: np.ndarray, sharding) -> jax.Array:
    """``value`` (the same on every process) as a global array with ``sharding``: each device
    takes its slice (under several processes too, where ``device_put`` of host data would not)."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def host_array(x: jax.Array) -> np.ndarray:
    """A global array's whole value on every process (gathered across processes when its
    shards live on several)."""
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
