"""The records of a layer's components, ``Mixer`` and ``Mlp``: what the model asks of a token
mixer and of an MLP kind (``models/components.py`` holds the tables and says how to add one);
and ``SubRecord``, the base of the architecture's sub-records, each owned by the component that
reads it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

from shardzoo.models import ModelError

Terms = dict  # {term name: bytes per device} of one layer (models/costs.py)


def _nothing(*_args) -> float:
    return 0


def _no_terms(*_args) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Mixer:
    """What the model asks of a token mixer. ``a`` is the architecture record (``TransformerArch``),
    ``spec`` the layer's ``LayerSpec``, ``block`` the ``transformer.Block`` being built (its config,
    spec, placement and decode flag), ``cost`` a ``costs.LayerCost`` (the config, the sequence
    length, the execution's attention kernel and ring, and ``t``: bytes of one activation)."""

    name: str
    # the names of ``arch.layer_types`` that select this mixer (attention: full, sliding, chunked)
    layer_types: tuple[str, ...]
    # (block, h, positions, segment_ids) -> [batch, length, embed]: the mixer of the normed input,
    # its flax module(s) created under the block (their names are the checkpoint's paths)
    apply: Callable
    # (a) -> (matmul parameters, multiplied once per token; the other parameters: norms, biases, scalars)
    params: Callable
    # (a, spec, seq_len) -> training FLOPs per token beyond 6 x the matmul parameters (attention's q.k and p.v)
    flops: Callable = _nothing
    # (a, spec, context) -> FLOPs of one generated token beyond 2 x the matmul parameters
    decode_flops: Callable = _nothing
    # (cost, spec) -> Terms: the arrays one layer's mixer keeps for the backward pass (models/costs.py's doc)
    activations: Callable = _no_terms
    # (cost) -> Terms kept once per model when some layer has this mixer (attention's mask)
    model_terms: Callable | None = None
    # (a, batch, length, nbytes) -> bytes of one layer's decoding cache; None: it keeps none
    cache_bytes: Callable | None = None
    # how it runs when the rules shard the length (context parallelism), or why it cannot
    context_parallel: str = ""
    # (a) -> None, or a ModelError naming the field: run when some layer has this mixer
    check: Callable | None = None
    # the architecture's sub-records it reads (``SubRecord`` classes): TransformerArch has a field for each
    records: tuple[type, ...] = ()
    # (a) -> the matmul parameters of routed experts that a token does not choose (models/moa.py):
    # counted in the model's size, not in its FLOPs; None: none
    idle_params: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Mlp:
    """What the model asks of an MLP kind (``Mixer``'s names)."""

    name: str
    # (block, h, segment_ids) -> [batch, length, embed]
    apply: Callable
    # (a, active) -> (matmul parameters (``active``: the top-k experts only), other parameters)
    params: Callable
    # (cost) -> Terms of one layer's MLP
    activations: Callable = _no_terms
    check: Callable | None = None
    records: tuple[type, ...] = ()
    # it takes the residual stream as it is and norms what it reads itself (Gemma 4's MoE block):
    # the block form gives it no norm before, its norm after as any MLP's
    reads_residual: bool = False


class SubRecord:
    """Base of a sub-record of the architecture (a frozen dataclass): the settings of one
    mechanism, a field ``NAME`` of ``TransformerArch`` that is None where no layer uses it. With
    ``OWNERS`` (the mixers or MLP kinds that read it) it exists exactly where a layer has one
    (its defaults where none was given); without, where it differs from its defaults.
    ``FLAT``: the flat names of its fields (older checkpoints, ``--override``, the families'
    mappings) -> its own; ``check(arch)`` what it says together with the rest of the record."""

    NAME: ClassVar[str]
    FEATURE: ClassVar[str]  # the feature a model with it uses (models/features.py)
    OWNERS: ClassVar[tuple[str, ...]] = ()
    FLAT: ClassVar[dict[str, str]] = {}

    def check(self, arch) -> None:
        """A ModelError for what it cannot be beside ``arch``'s other settings."""

    def used(self, arch) -> bool:
        """Whether ``arch`` keeps it (records without ``OWNERS``): where it is not all defaults."""
        return self != type(self)()

    def flat(self) -> dict:
        """Its fields by their flat names (what the families' config.json mappings write)."""
        return {flat: getattr(self, name) for flat, name in self.FLAT.items()}

    @classmethod
    def of(cls, value):
        """``value`` as this record: None, one, the mapping a stored config holds, or a switch
        (true: the defaults; false: none)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, bool):
            return cls() if value else None
        if isinstance(value, dict):
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise ModelError(f"{cls.NAME}: unknown field {', '.join(unknown)}; fields: {', '.join(sorted(names))}")
            return cls(**value)
        raise ModelError(f"{cls.NAME}={value!r} is not a mapping of its fields")
