"""The sharding plan: where every parameter lives and what it costs per device.

``make_plan`` turns a validated train state (``validate.check``'s report of the params and the
recorded activation constraints, from the one trace in ``train/program.py``) into, for every
parameter, its path, shape, dtype, logical axes, mesh spec, per-device shape and bytes, and
which rule won (or lost) each dimension. Totals per device: parameters, gradients (as
parameters), the optimizer state (as the program's optimizer holds it), the model's own
activation estimate, and a verdict against a device's memory; when the rules split a model's
layer stack into pipeline stages, the model's schedule, its bubble fraction and one stage's
share. Works on an ``AbstractMesh``, i.e. for a mesh larger than this machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding

from shardzoo.errors import UserError
from shardzoo.sharding.activations import Shards
from shardzoo.sharding.mesh import make_abstract_mesh, make_mesh, mesh_shape, parse_mesh_spec
from shardzoo.sharding.rules import Rules
from shardzoo.sharding.validate import Resolved, rule_text

# Decimal gigabytes, as vendors state them.
DEVICE_MEMORY = {"h100": 80e9, "h200": 141e9, "a100": 80e9, "v5p": 95e9, "v5e": 16e9, "v4": 32e9}
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def local_device_memory(device=None) -> tuple[str, int] | None:
    """(label, bytes) of this machine's accelerator (``device``, default its first device): the
    memory a program may use there (``memory_stats()["bytes_limit"]``); None on a CPU or where
    the backend does not say."""
    device = jax.devices()[0] if device is None else device
    if device.platform == "cpu":
        return None
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - a backend without memory statistics: no verdict, not a failure
        return None
    return (f"local {device.device_kind} ({limit / 1e9:.1f} GB)", int(limit)) if limit else None


# The share of a device's memory a step leaves free when a fit is chosen for it (XLA's own
# figure is exact for the step's buffers; the rest is for the batch in flight and fragmentation).
FIT_HEADROOM = 0.03


@dataclasses.dataclass(frozen=True)
class Fit:
    """What ``first_fit`` tried: ``choice`` (None: nothing fits), ``needed`` each candidate's
    bytes in the order tried (None: the backend did not say), the device's ``limit`` and the
    ``budget`` a candidate must stay within (the limit less the headroom)."""

    choice: object
    needed: tuple[tuple[object, float | None], ...]
    limit: float
    budget: float


def first_fit(candidates, needed, limit: float, headroom: float = FIT_HEADROOM) -> Fit:
    """The first of ``candidates`` (ordered by preference, e.g. fastest first) whose
    ``needed(candidate)`` bytes per device fit ``limit`` less ``headroom``; the later ones are
    never asked. ``needed`` returns None when it cannot tell (taken as fitting)."""
    budget = limit * (1 - headroom)
    tried = []
    for candidate in candidates:
        n = needed(candidate)
        tried.append((candidate, n))
        if n is None or n <= budget:
            return Fit(candidate, tuple(tried), limit, budget)
    return Fit(None, tuple(tried), limit, budget)


def parse_device_memory(text) -> tuple[str, int]:
    """``"80GB"``, ``"16GiB"``, ``"1.5e9"`` or a device name (``h100``) to (label, bytes)."""
    key = str(text).strip().lower()
    if key in DEVICE_MEMORY:
        return f"{key} ({DEVICE_MEMORY[key] / 1e9:g} GB)", int(DEVICE_MEMORY[key])
    m = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)\s*([kmgt]i?b|b)?", key)
    if not m:
        raise UserError(
            f"device memory {text!r}: expected a size like 80GB or 16GiB, "
            f"or one of {', '.join(DEVICE_MEMORY)}"
        )
    if not m.group(2):  # a bare number is ambiguous: 80 could mean 80 GB as easily as 80 bytes
        raise UserError(f"device memory {text!r} has no unit: write {m.group(1)}GB (or {m.group(1)}GiB, "
                        f"or {m.group(1)}B for bytes), or one of {', '.join(DEVICE_MEMORY)}")
    size = float(m.group(1)) * _UNITS[m.group(2)]
    if not 0 < size < 2**63:
        raise UserError(f"device memory {text!r} must be more than 0 bytes")
    return str(text).strip(), int(size)


def planning_mesh(spec):
    """A real mesh when the spec fits the local devices (or has a -1), else an ``AbstractMesh``."""
    sizes = parse_mesh_spec(spec)
    if -1 in sizes.values() or math.prod(sizes.values()) == jax.device_count():
        return make_mesh(spec)
    return make_abstract_mesh(spec)


def format_bytes(n) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclasses.dataclass(frozen=True)
class Row:
    """One array of the plan: its assignment (``array``), per-device shape and bytes."""

    array: Resolved
    shard_shape: tuple[int, ...]
    bytes: int  # the whole array
    bytes_per_device: int

    def to_dict(self, rules) -> dict:
        a = self.array
        return {
            "path": a.path, "shape": list(a.shape), "dtype": a.dtype, "logical": list(a.names),
            "spec": [list(d.mesh_axes) or None for d in a.dims],
            "shard_shape": list(self.shard_shape), "bytes": self.bytes,
            "bytes_per_device": self.bytes_per_device,
            "dims": [d.to_dict(rules) for d in a.dims],
        }


def _row(array: Resolved, mesh) -> Row:
    shard = NamedSharding(mesh, array.spec).shard_shape(array.shape)
    itemsize = jnp.dtype(array.dtype).itemsize
    return Row(array, tuple(shard), math.prod(array.shape) * itemsize, math.prod(shard) * itemsize)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-array placements and per-device totals; ``format()`` for people, ``to_json()`` for tools."""

    model: str
    mesh: dict
    abstract_mesh: bool
    rules: Rules
    params: tuple[Row, ...]
    activations: tuple[Row, ...]  # logical constraints seen while tracing (not a memory total)
    totals: dict  # per device: params, gradients, optimizer, activations (estimate), total
    activation_estimate: object  # the model's estimate (models/costs.py), or None
    device_memory: tuple[str, int] | None
    problems: tuple[str, ...]  # non-strict mode's warnings
    pipeline: dict | None = None  # the model's pipeline schedule when the rules split its layers
    workload: dict | None = None  # what the plan is of: batch, microbatch, sequence, dtypes, remat

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.totals["total"] <= self.device_memory[1]

    def losers(self):
        """(path, dim index, DimMatch) for every dim where a rule lost because its mesh axis was taken."""
        return [
            (row.array.path, i, d)
            for row in self.params + self.activations
            for i, d in enumerate(row.array.dims)
            if d.losers
        ]

    def _shown_rules(self) -> list[int]:
        """The rules of the logical names this model's arrays have (not a Mamba's ``ssm_*`` for a
        Llama): each that decides a dimension or asks for a mesh axis; a ``name->null`` that
        never wins (a fallback behind an earlier rule of that name) is left out. The JSON keeps
        the whole table."""
        dims = [d for row in self.params + self.activations for d in row.array.dims]
        names, winners = {d.logical for d in dims}, {d.winner for d in dims}
        return [i for i, (name, axes) in enumerate(self.rules)
                if name in names and (i in winners or axes not in (None, (), ""))]

    def to_dict(self) -> dict:
        est = self.activation_estimate
        return {
            "model": self.model,
            "mesh": self.mesh,
            "num_devices": math.prod(self.mesh.values()),
            "abstract_mesh": self.abstract_mesh,
            "rules": {"name": self.rules.name, "table": [[n, m] for n, m in self.rules]},
            "params": [r.to_dict(self.rules) for r in self.params],
            "activations": [r.to_dict(self.rules) for r in self.activations],
            "totals": self.totals,
            "activation_estimate": None if est is None else dataclasses.asdict(est),
            "device_memory": None if self.device_memory is None else {
                "device": self.device_memory[0], "bytes": self.device_memory[1], "fits": self.fits,
                "fraction": self.totals["total"] / self.device_memory[1],
            },
            "problems": list(self.problems),
            "pipeline": self.pipeline,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format(self) -> str:
        """A table for people: one line per array, the rule decisions, then the totals."""
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "one device"
        kind = "abstract mesh, no devices" if self.abstract_mesh else "local devices"
        out = [f"plan for {self.model}: rules {self.rules.name!r} on mesh {mesh} "
               f"({math.prod(self.mesh.values())} devices, {kind})"]
        if self.workload:
            w = self.workload
            out.append("workload: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in w.items() if v is not None))
        out += _wrap_entries([rule_text(self.rules, i) for i in self._shown_rules()], "rules: ", 100)
        out.append("")
        sections = (("parameters", self.params), ("activations (logical constraints)", self.activations))
        for title, rows in sections:
            if not rows:
                continue
            table = [(r.array.path, str(r.array.shape), r.array.dtype, _dims_text(r.array),
                      str(r.shard_shape), format_bytes(r.bytes_per_device)) for r in rows]
            head = ("path", "shape", "dtype", "logical->mesh (rule)", "per device", "bytes/device")
            widths = [max(len(x[i]) for x in table + [head]) for i in range(len(head))]
            out.append(title)
            for line in [head] + table:
                cells = (c.ljust(w) for c, w in zip(line, widths, strict=True))
                out.append(("  " + "  ".join(cells)).rstrip())
            out.append("")
        losers = self.losers()
        if losers:
            out.append("rules that lost because their mesh axes were taken")
            for path, i, d in losers:
                lost = "; ".join(
                    f"{rule_text(self.rules, lo.rule)} ({','.join(lo.taken)} taken)" for lo in d.losers
                )
                out.append(f"  {path} dim {i} ({d.logical}): {lost}")
            out.append("")
        t, est = self.totals, self.activation_estimate
        lines = [
            ("parameters", t["params"]),
            ("gradients", t["gradients"]),
            ("optimizer state", t["optimizer"]),
            *([("reference model", t["reference"])] if "reference" in t else []),
            *([("reward model", t["reward_model"])] if "reward_model" in t else []),
            ("activations (estimate)", t["activations"]),
            *([("rollouts (KV cache)", t["rollouts"])] if "rollouts" in t else []),
            ("total", t["total"]),
        ]
        width = max(len(k) for k, _ in lines)
        out.append(f"per device ({t['param_count']:,} parameters in all)")
        out += [f"  {k.ljust(width)}  {format_bytes(v)}" for k, v in lines]
        if est is not None:
            out.append(f"  activation estimate: remat {est.policy}: {est.formula}")
        if self.pipeline is not None:
            pipe = self.pipeline
            out.append(f"  {pipe['text']}")
            per_stage = math.prod(self.mesh.values()) // pipe["stages"]
            out.append(f"  per stage: {pipe['stages_layers']} layers; each of its {per_stage} devices holds the "
                       f"totals above ({format_bytes(t['total'])}); idle {100 * pipe['bubble_fraction']:.1f}% "
                       "of a step")
        if self.device_memory is not None:
            label, cap = self.device_memory
            verdict = "fits" if self.fits else "DOES NOT FIT"
            share = f"{100 * t['total'] / cap:.1f}% of {format_bytes(cap)}"
            out.append(f"  device {label}: {verdict} ({share})")
        else:
            out.append(f"  no device memory named and no accelerator here: add --device-memory "
                       f"({', '.join(DEVICE_MEMORY)} or a size such as 80GB) for a fits verdict")
        for p in self.problems:
            out.append(f"warning: {p}")
        return "\n".join(out)


def _wrap_entries(entries, first: str, width: int) -> list[str]:
    """Entries two spaces apart, lines of at most ``width``, never breaking an entry."""
    lines, line = [], first
    for entry in entries:
        if line.strip() and len(line) + 2 + len(entry) > width and line != first:
            lines.append(line)
            line = " " * len(first) + entry
        else:
            line += ("  " if line != first else "") + entry
    return lines + [line]


def _dims_text(array: Resolved) -> str:
    parts = []
    for d in array.dims:
        axes = "+".join(d.mesh_axes) or "-"
        if d.dropped:
            axes += f"(not {'+'.join(d.dropped)}: indivisible)"
        rule = "" if d.winner is None else f" #{d.winner}"
        parts.append(f"{d.logical}:{axes}{rule}")
    return " ".join(parts)


def make_plan(report, mesh, model_config=None, *, micro_batch: int, seq_len: int | None,
              optimizer_bytes: int, gradient_bytes: int | None = None, device_memory=None,
              name=None, workload: dict | None = None, reference_bytes: int | None = None,
              rollout_bytes: int | None = None, reward_model_bytes: int | None = None) -> Plan:
    """The plan of a validated train state (``validate.Report`` of its params and activations).

    ``optimizer_bytes``: the optimizer state's bytes per device (the program knows them from
    its own optimizer and shardings); ``reference_bytes`` those of a frozen reference model
    (preference tasks; 0 when the reference costs no parameters, None without one);
    ``rollout_bytes`` those of the decoding cache that samples a step's completions (GRPO; held
    while sampling, when the step's activations are not, so the total counts the larger);
    ``reward_model_bytes`` those of a frozen reward model's params (GRPO's ``--reward-model``);
    ``gradient_bytes`` those of the gradients (default: as the
    params; less when only some params train, as LoRA's adapters). The activation estimate is the model's own
    (``model_config.activation_estimate(micro_batch, seq_len, shards)``, where ``shards(names)``
    says how many devices split an array with those logical names); sharding reads no model
    field.
    """
    params = tuple(_row(a, mesh) for a in report.params)
    acts = tuple(_row(a, mesh) for a in report.activations)
    totals = {
        "param_count": sum(math.prod(r.array.shape) for r in params),
        "params": sum(r.bytes_per_device for r in params),
        "gradients": (sum(r.bytes_per_device for r in params) if gradient_bytes is None
                      else int(gradient_bytes)),
        "optimizer": int(optimizer_bytes),
    }
    if reference_bytes is not None:
        totals["reference"] = int(reference_bytes)
    if rollout_bytes is not None:
        totals["rollouts"] = int(rollout_bytes)
    if reward_model_bytes is not None:
        totals["reward_model"] = int(reward_model_bytes)
    est = None
    if model_config is not None:
        est = model_config.activation_estimate(micro_batch, seq_len, Shards(report.rules, mesh))
    pipeline = None
    if model_config is not None:
        pipeline = model_config.pipeline_plan(micro_batch, Shards(report.rules, mesh))
    totals["activations"] = None if est is None else est.bytes
    totals["total"] = (totals["params"] + totals["gradients"] + totals["optimizer"]
                       + totals.get("reference", 0) + totals.get("reward_model", 0) + max(totals["activations"] or 0, totals.get("rollouts", 0)))
    if device_memory is not None and not isinstance(device_memory, tuple):
        device_memory = parse_device_memory(device_memory)
    return Plan(
        model=name or type(model_config).__name__,
        mesh=mesh_shape(mesh),
        abstract_mesh=isinstance(mesh, AbstractMesh),
        rules=report.rules,
        params=params,
        activations=acts,
        totals=totals,
        activation_estimate=est,
        device_memory=device_memory,
        problems=tuple(p.message for p in report.problems),
        pipeline=pipeline,
        workload=workload,
    )
