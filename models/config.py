"""A model config: its architecture record and its execution record, and the interface that
train, plan and advise use.

``ModelConfig`` pairs the two records (``arch``, ``execution``); each model family subclasses it
(``TransformerConfig``, ``MLPConfig``). Fields of either record are read by name
(``config.hidden_size``, ``config.dtype``) and set by name (``config.replace(hidden_size=64,
dtype="bfloat16")``, ``--override``), each routed to its record. ``to_dict`` and
``from_dict`` are what checkpoints store and read back, including the flat dicts that
checkpoints written before the split hold.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from typing import ClassVar, Protocol, runtime_checkable

from shardzoo.models import ModelError

# a record class's annotations resolved, once per class (``replace`` asks on every call)
type_hints = functools.cache(typing.get_type_hints)


@runtime_checkable
class ModelInterface(Protocol):
    """What train, plan and advise ask of a model, and nothing more."""

    arch: object
    execution: object
    task: ClassVar[str]  # "lm", "classification" or "regression"

    def build(self, placement=None):
        """The flax module; ``placement`` (sharding.partition.Placement) gives its mesh and rules."""

    def sample_inputs(self, batch_size: int, seq_len: int | None) -> tuple:
        """ShapeDtypeStructs of what ``init`` is called on."""

    def num_params(self, active: bool = False) -> int: ...

    def flops_per_token(self, seq_len: int | None) -> float: ...

    def activation_estimate(self, batch_size: int, seq_len: int | None, shards):
        """Activation bytes a train step keeps per device (``models/costs.py``)."""

    def pipeline_plan(self, batch_size: int, shards) -> dict | None: ...

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model takes (None: no sequence)."""

    @property
    def trains(self) -> Callable | None:
        """The predicate on parameter paths a run trains (LoRA: the adapters); None: all."""

    @property
    def remat_policies(self) -> tuple[str, ...]:
        """The remat policies the model accepts (empty: it has none to choose)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """An architecture record and an execution record (see the module docstring)."""

    arch: object
    execution: object

    ARCH: ClassVar[type]
    EXECUTION: ClassVar[type]

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """What the two records say together (a family adds its checks)."""

    def __getattr__(self, name):
        # Only called for names that are not the two records: a field or property of either.
        if name.startswith("__") or name in ("arch", "execution"):
            raise AttributeError(name)
        for record in (self.arch, self.execution):
            if hasattr(record, name):
                return getattr(record, name)
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    @classmethod
    def field_types(cls) -> dict[str, tuple[str, object]]:
        """``{field: (record, annotation)}`` of every settable field."""
        out = {}
        for record, kind in (("arch", cls.ARCH), ("execution", cls.EXECUTION)):
            hints = type_hints(kind)
            for f in dataclasses.fields(kind):
                out[f.name] = (record, hints[f.name])
        return out

    @classmethod
    def from_fields(cls, **fields):
        """A config from fields of either record by name (unknown names: a ModelError)."""
        return cls(cls.ARCH(), cls.EXECUTION()).replace(**fields)

    def replace(self, **fields):
        """A copy with fields of either record replaced by name."""
        types = self.field_types()
        unknown = sorted(set(fields) - set(types))
        if unknown:
            raise ModelError(f"unknown field {', '.join(unknown)}; fields: {', '.join(sorted(types))}")
        parts = {"arch": {}, "execution": {}}
        for name, value in fields.items():
            parts[types[name][0]][name] = value
        try:
            arch = dataclasses.replace(self.arch, **parts["arch"]) if parts["arch"] else self.arch
            execution = (dataclasses.replace(self.execution, **parts["execution"])
                         if parts["execution"] else self.execution)
        except (TypeError, ValueError) as e:
            if isinstance(e, ModelError):
                raise
            raise ModelError(str(e)) from None
        return dataclasses.replace(self, arch=arch, execution=execution)

    def resolved(self):
        """This config with every choice made explicit (a family resolves what it defers)."""
        return self

    def to_dict(self) -> dict:
        """``{"arch": {...}, "execution": {...}}``, JSON-ready (tuples as lists)."""
        return {"arch": _jsonable(dataclasses.asdict(self.arch)),
                "execution": _jsonable(dataclasses.asdict(self.execution))}

    @classmethod
    def from_dict(cls, stored: dict):
        """The config ``to_dict`` wrote, or a flat dict of fields (checkpoints before the split:
        ``upgrade_fields`` maps their retired fields first)."""
        if set(stored) == {"arch", "execution"}:
            flat = {**stored["arch"], **stored["execution"]}
        else:
            flat = cls.upgrade_fields(dict(stored))
        return cls.from_fields(**{k: _tuples(v) for k, v in flat.items()})

    @classmethod
    def upgrade_fields(cls, flat: dict) -> dict:
        """Fields of an older flat config in today's names (a family overrides this)."""
        return flat


def _frozen(self, name, *value):
    raise dataclasses.FrozenInstanceError(f"cannot assign to or delete field {name!r}")


# frozen in every subclass too (the dataclass's own check spares subclasses' new attributes)
ModelConfig.__setattr__ = _frozen
ModelConfig.__delattr__ = _frozen


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _tuples(value):
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value
