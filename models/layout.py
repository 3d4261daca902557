"""Which layers are scanned: an unrolled prefix, one scanned run of periods, an unrolled rest.

A model's layers are a sequence of ``LayerSpec``s (``TransformerArch.layer_specs``). Scanning
runs one *period* of ``p`` layers per step, each of the period's layers with its own parameters
(``layers/sub_j``; ``layers`` itself when ``p == 1``, every parameter with a leading ``layers``
axis), ``repeats`` times; the layers before (DeepSeek's first dense layers) and after (the part
of a period left over) are unrolled as ``layers_i``. So every pattern scans, and a model's
compile time stays flat in its depth.

``auto_layout`` picks the layout that traces the fewest blocks (the period's plus the unrolled
ones), preferring no prefix; an explicit ``(prefix, period, repeats)`` (the execution record's
``scan_layout``, e.g. the layout an older checkpoint was written in) must fit the pattern.
"""

from __future__ import annotations

import dataclasses

from shardzoo.models import ModelError


@dataclasses.dataclass(frozen=True)
class Layout:
    """Layers ``[0, prefix)`` unrolled, ``repeats`` scanned steps of ``period`` layers, the rest
    unrolled; ``repeats == 0``: nothing scanned."""

    num_layers: int
    prefix: int = 0
    period: int = 1
    repeats: int = 0

    @property
    def scanned(self) -> int:
        return self.period * self.repeats

    @property
    def unrolled(self) -> tuple[int, ...]:
        """The layers built one by one (``layers_i``), in order: the prefix, then the rest."""
        end = self.prefix + self.scanned
        return tuple(range(self.prefix)) + tuple(range(end, self.num_layers))

    def period_layers(self, j: int) -> tuple[int, ...]:
        """The model layers that position ``j`` of the period runs, one per scanned step."""
        return tuple(self.prefix + j + k * self.period for k in range(self.repeats))

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.prefix, self.period, self.repeats)

    def param_layout(self) -> list[tuple[tuple[str, ...], tuple[int, ...], bool]]:
        """Where each layer's parameters live: ``(path prefix, layers, stacked)``; a stacked
        prefix holds its layers on a leading axis in that order, else it holds one layer."""
        out = [((f"layers_{i}",), (i,), False) for i in range(self.prefix)]
        if self.repeats:
            if self.period == 1:
                out.append((("layers",), self.period_layers(0), True))
            else:
                out += [(("layers", f"sub_{j}"), self.period_layers(j), True) for j in range(self.period)]
        end = self.prefix + self.scanned
        return out + [((f"layers_{i}",), (i,), False) for i in range(end, self.num_layers)]


def _repeats(specs, start: int, period: int) -> int:
    """Whole periods of ``period`` layers, starting at ``start``, that repeat the first one."""
    k = 1
    while start + (k + 1) * period <= len(specs) and all(
            specs[start + k * period + j] == specs[start + j] for j in range(period)):
        k += 1
    return k


def auto_layout(specs) -> Layout:
    """The layout that traces the fewest distinct blocks: a period repeated at least twice
    (a uniform model of one layer is one stack), the fewest unrolled layers on ties, then the
    shortest prefix and period."""
    n = len(specs)
    if n and all(s == specs[0] for s in specs):
        return Layout(n, 0, 1, n)
    best, best_key = Layout(n, n, 1, 0), (n, n, 0, 0)
    for prefix in range(n):
        for period in range(1, (n - prefix) // 2 + 1):
            k = _repeats(specs, prefix, period)
            if k < 2:
                continue
            unrolled = n - k * period
            key = (period + unrolled, unrolled, prefix, period)
            if key < best_key:
                best, best_key = Layout(n, prefix, period, k), key
    return best


def check_layout(layout: tuple[int, int, int], specs) -> Layout:
    """An explicit ``(prefix, period, repeats)``, checked against the layers' pattern."""
    n = len(specs)
    prefix, period, repeats = layout
    if repeats and (period < 1 or prefix + period * repeats > n):
        raise ModelError(f"scan_layout={list(layout)} (prefix, period, repeats) does not fit "
                         f"num_hidden_layers={n}")
    for j in range(period if repeats else 0):
        layers = [prefix + j + k * period for k in range(repeats)]
        if any(specs[i] != specs[layers[0]] for i in layers):
            raise ModelError(f"scan_layout={list(layout)}: layers {layers} are not alike, so one "
                             f"scanned position cannot run them")
    return Layout(n, prefix, period if repeats else 1, repeats)


def layout_of(specs, scan: bool, explicit: tuple[int, int, int] | None) -> Layout:
    """The layout a model builds: none scanned without ``scan``, else the explicit or automatic one."""
    if not scan:
        return Layout(len(specs), len(specs), 1, 0)
    return check_layout(explicit, specs) if explicit is not None else auto_layout(specs)


# ------------------------------------------------------------------------------ moving layers
def _at(tree, path):
    for name in path:
        tree = tree[name]
    return tree


def relayout(params, source: Layout, target: Layout, index=None, stack=None):
    """``params`` of a model whose layers are laid out as ``source``, in ``target``'s layout:
    each layer's subtree cut out of its stack (``index(leaf, k)``, default ``leaf[k]``) and put
    where ``target`` keeps it, stacked with its period's other layers (``stack(leaves)``,
    default ``jnp.stack``); the other params as they are. ``index`` and ``stack`` given, it
    moves anything shaped like params (e.g. ShapeDtypeStructs)."""
    import jax
    import jax.numpy as jnp

    index = index or (lambda x, k: x[k])
    stack = stack or (lambda xs: jnp.stack(xs))
    tops = {path[0] for path, _, _ in source.param_layout()}
    out = {k: v for k, v in params.items() if k not in tops}
    layers = {}
    for path, indices, stacked in source.param_layout():
        tree = _at(params, path)
        for k, layer in enumerate(indices):
            layers[layer] = jax.tree.map(lambda x, k=k: index(x, k), tree) if stacked else tree
    for path, indices, stacked in target.param_layout():
        tree = jax.tree.map(lambda *xs: stack(xs), *[layers[i] for i in indices]) if stacked else layers[indices[0]]
        parent = out
        for name in path[:-1]:
            parent = parent.setdefault(name, {})
        parent[path[-1]] = tree
    return out


def relayout_abstract(target, source: Layout, dest: Layout):
    """``relayout`` of ShapeDtypeStructs with NamedShardings: a stacked axis is unsharded."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    def spec(x):
        return tuple(x.sharding.spec) + (None,) * (len(x.shape) - len(x.sharding.spec))

    def index(x, k):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype,
                                    sharding=NamedSharding(x.sharding.mesh, PartitionSpec(*spec(x)[1:])))

    def stack(xs):
        x = xs[0]
        return jax.ShapeDtypeStruct((len(xs),) + x.shape, x.dtype,
                                    sharding=NamedSharding(x.sharding.mesh, PartitionSpec(None, *spec(x))))

    return relayout(target, source, dest, index, stack)
