"""Strict checks of a model's logical axes against a rule table and a mesh, before compiling.

flax resolves logical names quietly: a name with no rule is replicated, and a rule whose mesh
axis is already used in the same array is skipped. shardzoo re-runs flax's own matching loop
(``flax.linen.spmd._logical_to_mesh_axes``) in ``match_dims``, recording which rule won each
dimension and which rules lost because their mesh axes were taken, and reports, with the
parameter (or activation) path:

- a logical name that is not in the vocabulary (``sharding/axes.py``);
- a logical name the model uses that has no rule at all in the table;
- a rule naming a mesh axis the mesh does not have;
- a dimension whose size is not divisible by the product of its mesh axes' sizes;
- an array that names one logical axis twice, or whose names do not match its rank.

Strict mode (the default) raises one ``ShardingValidationError`` listing every problem, one a
line. Non-strict mode issues a ``ShardingValidationWarning`` per problem and carries on:
rules naming unknown mesh axes are dropped and indivisible dimensions are replicated.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import Counter

import jax
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec

from shardzoo.errors import UserError
from shardzoo.sharding import axes as ax
from shardzoo.sharding.rules import Rules, get_rules


class ShardingValidationError(UserError):
    """Every problem found in one message, one per line; ``problems`` keeps them as a list."""

    def __init__(self, problems):
        # A rule naming a mesh axis the mesh lacks (a typo) explains the problems after it.
        self.problems = sorted(problems, key=lambda p: p.kind != "unknown_mesh_axis")
        super().__init__("\n".join(p.message for p in self.problems))

    def summary(self, context: str = "", hint: str = "") -> str:
        """Every problem for the command line: one line for one, else a count and one a line."""
        tail = f" [{hint}]" if hint else ""
        if len(self.problems) == 1:
            return f"{context}{self.problems[0].message}{tail}"
        lines = "".join(f"\n  {p.message}" for p in self.problems)
        return f"{context}{len(self.problems)} sharding problems{tail}:{lines}"


class ShardingValidationWarning(UserWarning):
    """A validation problem reported in non-strict mode."""


@dataclasses.dataclass(frozen=True)
class Problem:
    kind: str  # unknown_name | no_rule | unknown_mesh_axis | indivisible | duplicate | rank
    path: str  # the parameter or activation path, or the rule for a rule-table problem
    message: str


@dataclasses.dataclass(frozen=True)
class Loser:
    """A rule for a dimension's name that was skipped because its mesh axes were taken."""

    rule: int  # index in the rule table
    mesh_axes: tuple[str, ...]
    taken: tuple[str, ...]  # which of them other dimensions of the array already use


@dataclasses.dataclass(frozen=True)
class DimMatch:
    """How one dimension of one array was assigned to mesh axes."""

    logical: str | None
    winner: int | None  # index of the winning rule; None when no rule applied (replicated)
    mesh_axes: tuple[str, ...]  # () means replicated
    losers: tuple[Loser, ...] = ()
    dropped: tuple[str, ...] = ()  # non-strict: mesh axes removed because the size did not divide

    def to_dict(self, rules) -> dict:
        return {
            "logical": self.logical,
            "mesh_axes": list(self.mesh_axes),
            "rule": None if self.winner is None else rule_text(rules, self.winner),
            "lost": [
                {"rule": rule_text(rules, lo.rule), "taken": list(lo.taken)} for lo in self.losers
            ],
            **({"dropped_indivisible": list(self.dropped)} if self.dropped else {}),
        }


@dataclasses.dataclass(frozen=True)
class Resolved:
    """One array (parameter or constrained activation) with its per-dimension assignment."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    names: tuple  # logical names, one per dimension (None for an unnamed activation dim)
    dims: tuple[DimMatch, ...]

    @property
    def spec(self) -> PartitionSpec:
        return PartitionSpec(*(_spec_entry(d.mesh_axes) for d in self.dims))


def _as_tuple(mesh_axes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def _spec_entry(mesh_axes: tuple[str, ...]):
    return None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes


def rule_text(rules, index: int) -> str:
    logical, mesh_axes = rules[index]
    shown = "null" if mesh_axes is None else ",".join(_as_tuple(mesh_axes)) or "null"
    return f"#{index} {logical}->{shown}"


def match_dims(names, rules) -> tuple[DimMatch, ...]:
    """flax's first-match loop over ``rules`` for one array's logical ``names``, recorded.

    Rules are tried in order; a rule applies to the (first) dimension with its logical name
    when that dimension is still unassigned and none of the rule's mesh axes is used by
    another dimension of the array. ``PartitionSpec`` of the result equals
    ``nn.logical_to_mesh_axes(names, rules)``.
    """
    names = tuple(names)
    assigned: list[tuple[str, ...] | None] = [None] * len(names)
    winners: list[int | None] = [None] * len(names)
    losers: list[list[Loser]] = [[] for _ in names]
    for i, (logical, mesh_axes) in enumerate(rules):
        if logical not in names:
            continue
        pos = names.index(logical)
        if assigned[pos] is not None:
            continue  # already won by an earlier rule
        wanted = _as_tuple(mesh_axes)
        used = {a for axes in assigned if axes for a in axes}
        taken = tuple(a for a in wanted if a in used)
        if taken:
            losers[pos].append(Loser(i, wanted, taken))
            continue
        assigned[pos], winners[pos] = wanted, i
    return tuple(
        DimMatch(n if isinstance(n, str) else None, w, a or (), tuple(lo))
        for n, w, a, lo in zip(names, winners, assigned, losers, strict=True)
    )


def mesh_sizes(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def rule_problems(rules, mesh) -> list[Problem]:
    """Rules naming a mesh axis that ``mesh`` does not have."""
    sizes = mesh_sizes(mesh)
    problems = []
    for i, (_, mesh_axes) in enumerate(rules):
        missing = [a for a in _as_tuple(mesh_axes) if a not in sizes]
        if missing:
            problems.append(
                Problem(
                    "unknown_mesh_axis",
                    f"rule {rule_text(rules, i)}",
                    f"rule table {getattr(rules, 'name', '') or 'rules'!r}: "
                    f"rule {rule_text(rules, i)} names mesh axis {', '.join(map(repr, missing))}, "
                    "which the mesh does not have "
                    f"(mesh axes: {', '.join(f'{k}={v}' for k, v in sizes.items())})",
                )
            )
    return problems


def usable_rules(rules, mesh) -> Rules:
    """``rules`` without the rules that name mesh axes the mesh lacks (non-strict mode)."""
    sizes = mesh_sizes(mesh)
    keep = [(n, m) for n, m in rules if all(a in sizes for a in _as_tuple(m))]
    return Rules(keep, name=getattr(rules, "name", ""))


def _fmt_axes(mesh_axes, sizes) -> str:
    return ",".join(f"{a}={sizes.get(a, '?')}" for a in mesh_axes)


def resolve_array(path, shape, dtype, names, rules, mesh, *, param=True):
    """``(Resolved, problems)`` for one array; indivisible dims are replicated in the result."""
    shape = tuple(shape)
    names = (None,) * len(shape) if names is None else tuple(names)
    sizes = mesh_sizes(mesh)
    problems = []
    shown = f"({', '.join(str(n) for n in names)})"
    if len(names) != len(shape):
        problems.append(Problem(
            "rank", path,
            f"{path}: logical axes {shown} name {len(names)} dims but shape {shape} has {len(shape)}",
        ))
        names = (names + (None,) * len(shape))[: len(shape)]
    if param and any(n is None for n in names):
        problems.append(Problem(
            "unnamed", path,
            f"{path}: shape {shape} has unnamed dimensions {shown}; "
            "name every dimension with nn.with_logical_partitioning",
        ))
    dups = [n for n, c in Counter(n for n in names if isinstance(n, str)).items() if c > 1]
    if dups:
        problems.append(Problem(
            "duplicate", path,
            f"{path}: logical axes {shown} name {', '.join(map(repr, dups))} more than once "
            "(flax refuses this)",
        ))
        names = tuple(None if n in dups and names.index(n) != i else n for i, n in enumerate(names))
    dims = list(match_dims(names, rules))
    for i, (size, dim) in enumerate(zip(shape, dims, strict=True)):
        n = math.prod(sizes.get(a, 1) for a in dim.mesh_axes)
        if size % n:
            problems.append(
                Problem(
                    "indivisible",
                    path,
                    f"{path}: dim {i} ({dim.logical}) of size {size} is not divisible by mesh axes "
                    f"{_fmt_axes(dim.mesh_axes, sizes)} (product {n}); "
                    f"logical axes {shown}, shape {shape}",
                )
            )
            dims[i] = dataclasses.replace(dim, mesh_axes=(), dropped=dim.mesh_axes)
    return Resolved(path, shape, str(dtype), names, tuple(dims)), problems


def _name_problems(arrays, rules) -> list[Problem]:
    """Logical names outside the vocabulary, and names used with no rule in the table."""
    users: dict[str, list[str]] = {}
    for path, names in arrays:
        for n in names or ():
            if isinstance(n, str):
                users.setdefault(n, []).append(path)
    ruled = {n for n, _ in rules}
    problems = []
    for name, paths in users.items():
        where = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        if name not in ax.ALL:
            problems.append(Problem(
                "unknown_name", paths[0],
                f"{where}: logical axis {name!r} is not in the vocabulary ({', '.join(ax.ALL)})",
            ))
        elif name not in ruled:
            problems.append(
                Problem(
                    "no_rule",
                    paths[0],
                    f"{where}: logical axis {name!r} has no rule in rule table "
                    f"{getattr(rules, 'name', '') or 'rules'!r} (flax would replicate it silently); "
                    f"add [{name}, null] to replicate it on purpose",
                )
            )
    return problems


@dataclasses.dataclass(frozen=True)
class Activation:
    """An activation constraint seen while tracing (``models.layers.recording_constraints``)."""

    path: str
    names: tuple
    shape: tuple[int, ...]
    dtype: str


def _is_box(x) -> bool:
    return isinstance(x, nn.Partitioned)


@dataclasses.dataclass(frozen=True)
class Report:
    """The outcome of ``check``: resolved parameters and activations, problems, usable rules."""

    params: tuple[Resolved, ...]
    activations: tuple[Resolved, ...]
    problems: tuple[Problem, ...]
    rules: Rules  # the table actually applied (non-strict: unknown-axis rules dropped)
    treedef: object

    def shardings(self, mesh):
        """NamedShardings for the checked tree, in its structure (unboxed leaves)."""
        return jax.tree_util.tree_unflatten(
            self.treedef, [NamedSharding(mesh, r.spec) for r in self.params]
        )


def check(abstract_tree, rules, mesh, *, activations=(), strict=True) -> Report:
    """Validate a boxed abstract tree (``jax.eval_shape(model.init, ...)``) against rules and mesh.

    ``activations`` are ``Activation`` records of the traced constraints. Raises
    ``ShardingValidationError`` listing every problem unless ``strict`` is False, in which
    case each problem becomes a ``ShardingValidationWarning``.
    """
    rules = get_rules(rules)
    table_problems = rule_problems(rules, mesh)
    applied = usable_rules(rules, mesh) if table_problems else rules
    problems = []
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_tree, is_leaf=_is_box)
    params, named = [], []
    for keypath, leaf in leaves:
        path = jax.tree_util.keystr(keypath, simple=True, separator="/")
        value = leaf.value if _is_box(leaf) else leaf
        names = tuple(leaf.names) if _is_box(leaf) else None
        res, probs = resolve_array(path, value.shape, value.dtype, names, applied, mesh)
        params.append(res)
        problems += probs
        named.append((path, names))
    acts = []
    for site in activations:
        res, probs = resolve_array(
            site.path, site.shape, site.dtype, site.names, applied, mesh, param=False
        )
        acts.append(res)
        problems += probs
        named.append((site.path, site.names))
    problems = table_problems + _name_problems(named, rules) + problems
    if problems:
        if strict:
            raise ShardingValidationError(problems)
        for p in problems:
            warnings.warn(p.message, ShardingValidationWarning, stacklevel=2)
    return Report(tuple(params), tuple(acts), tuple(problems), applied, treedef)
