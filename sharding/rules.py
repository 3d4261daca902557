"""Rule tables: ordered ``(logical_name, mesh_axes)`` pairs, as plain data.

Semantics are flax's (``nn.logical_to_mesh_axes``): for each dimension the rules for its
logical name are tried in order, and the first whose mesh axes are all still free in that
array wins. ``None`` means replicated. Every preset ends with the replicated base table, so
every name in the vocabulary has a rule.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

from shardzoo.errors import UserError
from shardzoo.sharding import axes as ax

DATA, FSDP, SEQUENCE, TENSOR, EXPERT = "data", "fsdp", "sequence", "tensor", "expert"
STAGE = "stage"  # pipeline stages: the layer stack is split along it (models/pipeline.py)
CONTEXT = "context"
# Outermost (slowest links, e.g. across hosts) to innermost (fastest, e.g. NVLink). `context`
# sits inside `sequence` and outside `tensor`: its ring passes K/V blocks to one neighbour per
# layer, a step that overlaps with the block's attention, while tensor parallelism all-reduces
# on the critical path of every matmul and needs the fastest links.
MESH_AXES = (DATA, STAGE, FSDP, EXPERT, SEQUENCE, CONTEXT, TENSOR)
# Mesh axes that hold the activations' `length` for context parallelism: attention over them
# runs as a ring (models/ring_attention.py); `length` over `sequence` alone leaves it to XLA.
CONTEXT_AXES = (CONTEXT,)

MeshAxes = str | tuple[str, ...] | None


class RuleError(UserError):
    """A rule table, a rule file or a preset name the user gave is malformed."""


def _norm_axes(mesh_axes, where: str) -> MeshAxes:
    if mesh_axes is None or isinstance(mesh_axes, str):
        return mesh_axes
    if isinstance(mesh_axes, Sequence) and all(isinstance(a, str) for a in mesh_axes):
        return mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes)
    raise RuleError(f"{where}: mesh axes must be a name, a list of names or null, got {mesh_axes!r}")


class Rules(tuple):
    """An ordered, immutable rule table; compares by value with any tuple of pairs."""

    def __new__(cls, pairs: Iterable = (), name: str = ""):
        norm = []
        for i, pair in enumerate(pairs):
            where = f"rule {i} of {name or 'rule table'}"
            if not (isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2):
                raise RuleError(f"{where}: expected a [logical_name, mesh_axes] pair, got {pair!r}")
            logical, mesh_axes = pair
            if logical not in ax.ALL:
                raise RuleError(
                    f"{where}: unknown logical axis {logical!r}; the vocabulary is {', '.join(ax.ALL)}"
                )
            norm.append((logical, _norm_axes(mesh_axes, where)))
        self = super().__new__(cls, norm)
        self.name = name
        return self

    def __add__(self, other):
        return Rules(tuple(self) + tuple(other), name=f"{self.name}+{getattr(other, 'name', '')}")

    def mesh_axes_used(self) -> set[str]:
        used = set()
        for _, mesh_axes in self:
            if isinstance(mesh_axes, str):
                used.add(mesh_axes)
            elif mesh_axes:
                used.update(mesh_axes)
        return used

    def __str__(self) -> str:
        return format_rules(self)


def format_rules(rules: Sequence) -> str:
    """A readable two-column table of a rule table: a row per logical axis in the order it first
    appears, its later rules as "(else ...)": flax takes the first rule of a name whose mesh axes
    the array's earlier dimensions have not taken (a preset's replicated tail is such a fallback)."""
    title = getattr(rules, "name", "") or "rules"
    shown: dict[str, list[str]] = {}
    for logical, mesh_axes in rules:
        text = "-" if mesh_axes is None else (mesh_axes if isinstance(mesh_axes, str) else ",".join(mesh_axes))
        shown.setdefault(logical, []).append(text)
    width = max([len(n) for n in shown] + [12])
    lines = [f"rule table: {title}", f"  {'logical axis':<{width}}  mesh axes"]
    for logical, (first, *rest) in shown.items():
        lines.append(f"  {logical:<{width}}  {first}" + "".join(f" (else {r})" for r in rest))
    return "\n".join(lines)


REPLICATED = Rules(((name, None) for name in ax.ALL), name="replicated")
_TP = ((ax.HEADS, TENSOR), (ax.KV_HEADS, TENSOR), (ax.MLP, TENSOR), (ax.CONV_CHANNELS, TENSOR), (ax.VOCAB, TENSOR),
       (ax.SSM_HEADS, TENSOR))
_TP += ((ax.LINEAR_HEADS, TENSOR), (ax.LINEAR_KEY_HEADS, TENSOR))  # linear attention's heads (Gated DeltaNet)

PRESETS: dict[str, Rules] = {
    "dp": Rules(((ax.BATCH, DATA),), "dp") + REPLICATED,
    "fsdp": Rules(((ax.BATCH, (DATA, FSDP)), (ax.EMBED, FSDP)), "fsdp") + REPLICATED,
    "tp": Rules(((ax.BATCH, DATA),) + _TP, "tp") + REPLICATED,
    "fsdp_tp": Rules(((ax.BATCH, (DATA, FSDP)), (ax.EMBED, FSDP)) + _TP, "fsdp_tp") + REPLICATED,
    "sp": Rules(((ax.BATCH, DATA), (ax.LENGTH, SEQUENCE)) + _TP, "sp") + REPLICATED,
    "cp": Rules(((ax.BATCH, DATA), (ax.LENGTH, CONTEXT)), "cp") + REPLICATED,
    "cp_fsdp": Rules(((ax.BATCH, (DATA, FSDP)), (ax.LENGTH, CONTEXT), (ax.EMBED, FSDP)), "cp_fsdp")
    + REPLICATED,
    "ep": Rules(
        (
            (ax.EXPERT, EXPERT),
            (ax.BATCH, (DATA, FSDP, EXPERT)),
            (ax.BATCH, (DATA, FSDP)),
            (ax.EMBED, FSDP),
        ),
        "ep",
    )
    + REPLICATED,
    # Pipeline: the layer stack over stage (a rule file with `base: pp` adds fsdp or tp inside a stage).
    "pp": Rules(((ax.LAYERS, STAGE), (ax.BATCH, DATA)), "pp") + REPLICATED,
    # ZeRO-1 optimizer-state table: pair with params under `dp` (see train/state.py).
    "zero1": Rules(((ax.BATCH, DATA), (ax.EMBED, DATA)), "zero1") + REPLICATED,
}
for _name, _table in PRESETS.items():
    _table.name = _name

PRESET_HELP = {
    "dp": "data parallel: batch over data, parameters replicated",
    "fsdp": "ZeRO-3: parameters sharded over fsdp along embed, batch over data+fsdp",
    "tp": "Megatron tensor parallel: heads, kv_heads, mlp, conv_channels, ssm_heads, vocab over tensor; batch over data",
    "fsdp_tp": "fsdp along embed plus tensor parallel",
    "sp": "tensor parallel plus activations' length over sequence (attention left to XLA)",
    "cp": "context parallel: activations' length over context (ring attention), batch over data",
    "cp_fsdp": "context parallel plus fsdp: length over context, parameters over fsdp along embed",
    "ep": "experts over expert, batch over data+fsdp+expert, the rest fsdp",
    "pp": "pipeline parallel: layer stack over stage, microbatches on a circular schedule; batch over data",
    "zero1": "optimizer-state table for ZeRO-1: state sharded over data along embed",
}


def list_presets() -> list[str]:
    return list(PRESETS)


def _load_file(path: str) -> Rules:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise RuleError(f"rule file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise RuleError(f"rule file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                        f"{e.start}): a rule file is YAML or JSON") from None
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        raise RuleError(f"rule file {path}: cannot parse: {e}".splitlines()[0]) from None
    base = None
    if isinstance(data, dict):
        unknown = set(data) - {"base", "rules"}
        if unknown:
            raise RuleError(f"rule file {path}: unknown keys {sorted(unknown)}; expected 'base' and 'rules'")
        base = data.get("base")
        data = data.get("rules") or []
    if not isinstance(data, list):
        raise RuleError(f"rule file {path}: expected a list of [logical_name, mesh_axes] pairs")
    name = os.path.basename(path)
    try:
        own = Rules(data, name=name)
    except RuleError as e:
        raise RuleError(f"rule file {path}: {e}") from None
    if base is not None:
        if base not in PRESETS:
            raise RuleError(f"rule file {path}: unknown base preset {base!r}; presets: {', '.join(PRESETS)}")
        own = own + PRESETS[base]
        own.name = f"{name} (base {base})"
    return own


def get_rules(name_or_path) -> Rules:
    """A preset by name, a YAML/JSON rule file by path, or a table given as pairs."""
    if isinstance(name_or_path, Rules):
        return name_or_path
    if not isinstance(name_or_path, str):
        return Rules(name_or_path, name="custom")
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if os.path.splitext(name_or_path)[1] in (".yaml", ".yml", ".json") or os.path.exists(name_or_path):
        return _load_file(name_or_path)
    raise RuleError(f"unknown rule preset {name_or_path!r}; presets: {', '.join(PRESETS)} (or a .yaml/.json file)")
