"""Rank rule tables and mesh shapes for a model on a topology, before anyone rents it.

``advise`` enumerates, for every candidate rule table, the factorizations of the device count
over the mesh axes the table uses, times the model's variants (remat policies, from the
caller), with gradient accumulation where memory asks for it. Each candidate is validated and
planned exactly as ``shardzoo plan`` plans it (``validate.check`` + ``plan.make_plan`` on an
``AbstractMesh``, from ONE trace of the train state that the caller's Program made); what does
not fit the device memory less a headroom is dropped, the rest is ranked by an estimated step
time. Sharding knows no model: the model's costs come in through the plan interface (its
activation estimate per variant) and three numbers (training FLOPs per token, recomputed
FLOPs per token of each variant, whether sibling kernels run as one matmul).

The cost model (what each candidate's collectives, compute and step time are) is
``cost_model.py``'s, documented there.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

from shardzoo.errors import UserError
from shardzoo.sharding import axes as ax
from shardzoo.sharding.cost_model import (  # noqa: F401 - the names advise's callers import from here
    DEVICES,
    KINDS,
    OVERLAP,
    RING_AXES,
    SHORT,
    AdviseError,
    Candidate,
    Device,
    Transfer,
    _eff,
    _nbytes,
    _prod,
    collectives,
    get_device,
    link_seconds,
    step_cost,
)
from shardzoo.sharding.mesh import make_abstract_mesh
from shardzoo.sharding.plan import format_bytes, make_plan
from shardzoo.sharding.rules import MESH_AXES, get_rules
from shardzoo.sharding.validate import (
    Activation,
    ShardingValidationError,
    ShardingValidationWarning,
    check,
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the model (a remat policy): its config, for the plan's activation
    estimate, and the FLOPs per token its backward recomputes."""

    label: str
    config: object
    recompute_flops_per_token: float = 0.0


def factorizations(n: int, axes) -> list[dict[str, int]]:
    """Every ordered way to write ``n`` as a product of sizes over ``axes`` (sizes >= 1)."""
    axes = list(axes)
    if not axes:
        return [{}] if n == 1 else []
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out += [{axes[0]: d, **rest} for rest in factorizations(n // d, axes[1:])]
    return out


@dataclasses.dataclass
class Advice:
    """The ranking: fitting candidates best first, the rejected with their reasons, the inputs."""

    model: str
    num_devices: int
    device: Device
    batch_size: int
    seq_len: int | None
    headroom: float
    ranked: list  # fitting candidates, best first
    rejected: list  # candidates that do not fit or do not validate
    seconds: float = 0.0
    verify: list | None = None  # filled by train/advise.py
    tables: dict = dataclasses.field(default_factory=dict)  # rule table name -> Rules

    def to_dict(self, top: int | None = None) -> dict:
        return {
            "model": self.model, "num_devices": self.num_devices,
            "device": dataclasses.asdict(self.device), "batch_size": self.batch_size,
            "seq_len": self.seq_len, "headroom": self.headroom,
            "overlap": OVERLAP, "ranked": [c.to_dict() for c in self.ranked[:top]],
            "rest": [c.to_dict() for c in self.ranked[top:]] if top else [],
            "rejected": [c.to_dict() for c in self.rejected], "seconds": self.seconds,
            "verify": self.verify,
        }

    def to_json(self, top: int | None = None) -> str:
        return json.dumps(self.to_dict(top), indent=2, default=str)

    def format(self, top: int = 5) -> str:
        return format_advice(self, top)


def _signature(report, sizes) -> frozenset:
    """Each mesh axis of size > 1 as (size, the array dims it shards), whatever its name: equal
    for candidates that place every array alike (``fsdp`` with data=8 is ``dp`` with data=8)."""
    shards: dict[str, set] = {a: set() for a, n in sizes.items() if n > 1}
    for r in report.params + report.activations:
        for i, d in enumerate(r.dims):
            for a in _eff(d.mesh_axes, sizes):
                shards[a].add((r.path, i))
    merged: dict[frozenset, int] = {}
    for a, s in shards.items():  # axes that shard the same dims act as one (data=2,expert=8: 16)
        merged[frozenset(s)] = merged.get(frozenset(s), 1) * sizes[a]
    return frozenset((n, s) for s, n in merged.items())


def _scaled_sites(sites, micro_batch: int):
    out = []
    for s in sites:
        shape = tuple(micro_batch if n == ax.BATCH else d for n, d in zip(s.names, s.shape, strict=True))
        out.append(Activation(s.path, s.names, shape, s.dtype))
    return out


def advise(boxed_params, boxed_opt_state, sites, variants, *, tables, num_devices: int,
           device: Device, batch_size: int, seq_len: int | None, flops_per_token: float,
           headroom: float = 0.1, fused: bool = True, name: str = "model",
           max_grad_accum: int = 64) -> Advice:
    """Enumerate, plan, cost and rank every (table, mesh, variant, grad accumulation).

    ``boxed_params``, ``boxed_opt_state`` and ``sites`` come from one Program's trace (its
    batch dimension is rescaled per microbatch); ``variants`` are the model's ways to run
    (``Variant``); ``tables`` are rule tables (or names and files).
    """
    import time

    start = time.perf_counter()
    if num_devices < 1:
        raise AdviseError(f"--devices {num_devices}: need at least one device")
    if not 0 <= headroom < 1:
        raise AdviseError(f"headroom {headroom}: must be in [0, 1)")
    tables = [get_rules(t) for t in tables]
    budget = device.memory * (1 - headroom)
    tokens = batch_size * (seq_len or 1)
    model_flops = flops_per_token * tokens
    ranked, rejected, signatures = [], [], {}
    for rules in tables:
        used = [a for a in MESH_AXES if a in rules.mesh_axes_used()]
        used += sorted(a for a in rules.mesh_axes_used() if a not in MESH_AXES)
        for shape in factorizations(num_devices, used or [MESH_AXES[0]]):
            mesh = make_abstract_mesh(shape)
            sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
            cand = Candidate(rules.name, sizes)
            try:
                report = check({"params": boxed_params}, rules, mesh,
                               activations=_scaled_sites(sites, batch_size), strict=True)
            except ShardingValidationError as e:
                cand.reason = "does not divide: " + e.problems[0].message
                rejected.append(cand)
                continue
            idle = [a for a, n in sizes.items() if n > 1 and not any(
                a in d.mesh_axes for r in report.params + report.activations for d in r.dims)]
            if idle:
                cand.reason = (f"does not divide: mesh axis {idle[0]}={sizes[idle[0]]} shards no array "
                               "of the model (its devices would repeat each other's work)")
                rejected.append(cand)
                continue
            sig = _signature(report, sizes)
            if sig in signatures:
                continue  # the same placement as an earlier table's candidate
            signatures[sig] = cand
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ShardingValidationWarning)
                opt = check(boxed_opt_state, rules, mesh, strict=False) if boxed_opt_state else None
            opt_bytes = 0 if opt is None else sum(
                _nbytes(r) // _prod({a for d in r.dims for a in _eff(d.mesh_axes, sizes)}, sizes)
                for r in opt.params)
            best, smallest, refused = None, None, None
            for variant in variants:
                accum = 1
                while accum <= max_grad_accum and batch_size % accum == 0:
                    mb = batch_size // accum
                    try:
                        rep = report if accum == 1 else check(
                            {"params": boxed_params}, rules, mesh,
                            activations=_scaled_sites(sites, mb), strict=True)
                    except ShardingValidationError:
                        break  # the microbatch no longer divides over the batch axes
                    try:
                        plan = make_plan(rep, mesh, variant.config, micro_batch=mb, seq_len=seq_len,
                                         optimizer_bytes=opt_bytes, name=name)
                    except UserError as e:  # the model refuses this split (e.g. its schedule)
                        refused = str(e)
                        break
                    total = plan.totals["total"]
                    if smallest is None or total < smallest[0]:
                        smallest = (total, plan.totals, variant.label, accum)
                    if total <= budget:
                        pipe = getattr(plan, "pipeline", None)  # the model's pipeline schedule
                        c = step_cost(rules.name, sizes, variant, accum, plan.totals, rep, device,
                                      model_flops, tokens, fused, num_devices, pipe)
                        if best is None or c.step_s < best.step_s:
                            best = c
                        break
                    state = plan.totals["params"] + plan.totals["gradients"] + plan.totals["optimizer"]
                    if state > budget:
                        break  # no accumulation shrinks the state
                    accum *= 2
            if best is None and smallest is None:
                cand.reason = f"does not divide: {refused}"
                rejected.append(cand)
            elif best is None:
                total, totals, label, accum = smallest
                cand.memory, cand.variant, cand.grad_accum = totals, label, accum
                cand.reason = (f"does not fit: needs {format_bytes(total)} per device at best "
                               f"(remat {label}, grad_accum {accum}), budget {format_bytes(budget)}")
                rejected.append(cand)
            else:
                ranked.append(best)
    ranked.sort(key=lambda c: c.step_s)
    if ranked:
        win = ranked[0]
        for c in ranked[1:]:
            c.reason = f"{c.step_s / win.step_s:.2f}x the best step: {c.bound}"
    return Advice(name, num_devices, device, batch_size, seq_len, headroom, ranked, rejected,
                  seconds=time.perf_counter() - start, tables={t.name: t for t in tables})


def format_advice(advice: Advice, top: int = 5) -> str:
    """The top candidates as a table, then why the rest lost; for people."""
    a, dev = advice, advice.device
    seq = f" x {a.seq_len} tokens" if a.seq_len else ""
    out = [f"advise {a.model}: {a.num_devices} x {dev.name} ({format_bytes(dev.memory)}, "
           f"{dev.peak_flops / 1e12:g} TFLOP/s, {dev.per_host} per host), batch {a.batch_size}{seq}",
           f"links: host {dev.host_bw / 1e9:g} GB/s, network {dev.network_bw / 1e9:g} GB/s per device "
           f"({dev.source})",
           f"fits: per-device plan total <= {100 * (1 - a.headroom):g}% of memory "
           f"({format_bytes(dev.memory * (1 - a.headroom))}); overlap: {OVERLAP}",
           f"{len(a.ranked)} candidates fit, {len(a.rejected)} do not "
           f"(planned in {a.seconds:.1f} s)", ""]
    if not a.ranked:
        out.append("nothing fits: try more devices, a larger device, a smaller batch or sequence")
    head = ("#", "rules", "mesh", "remat", "accum", "params+grads+opt", "acts", "total",
            "AG / AR+RS / A2A", "compute", "comm hid/exp", "step", "MFU")
    rows = []
    for i, c in enumerate(a.ranked[:top], 1):
        m, b = c.memory, c.collective_bytes
        rows.append((str(i), c.rules, c.mesh_text, c.variant, str(c.grad_accum),
                     format_bytes(m["params"] + m["gradients"] + m["optimizer"]),
                     format_bytes(m["activations"] or 0), format_bytes(m["total"]),
                     " / ".join(format_bytes(x) for x in (
                         b["all-gather"], b["all-reduce"] + b["reduce-scatter"], b["all-to-all"])),
                     f"{c.compute_s:.3g}s", f"{c.hidden_s:.3g}s/{c.exposed_s:.3g}s",
                     f"{c.step_s:.3g}s", f"{100 * c.mfu:.0f}%"))
    if rows:
        widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
        for r in [head] + rows:
            out.append("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip())
        out.append("memory per device (plan); collective bytes per step per device, whole "
                   "buffers (AR+RS: gradient reductions and tensor-parallel all-reduces)")
        for i, c in enumerate(a.ranked[:top], 1):
            links = ", ".join(f"{SHORT[k]} over {v}" for k, v in c.link.items())
            out.append(f"  #{i}: {c.bound}" + (f"; {links}" if links else ""))
    rest = a.ranked[top:]
    if rest or a.rejected:
        out += ["", "why the rest lost"]
        for c in rest[:top]:
            out.append(f"  {c.rules} {c.mesh_text} (remat {c.variant}, accum {c.grad_accum}): "
                       f"{c.step_s:.3g} s, {c.reason}")
        if len(rest) > top:
            out.append(f"  ... {len(rest) - top} more slower candidates (--json lists them)")
        by_table: dict[str, list] = {}
        for c in a.rejected:
            by_table.setdefault(c.rules, []).append(c)
        for table, cands in by_table.items():
            fit = [c for c in cands if c.reason.startswith("does not fit")]
            bad = [c for c in cands if not c.reason.startswith("does not fit")]
            if fit:
                c = min(fit, key=lambda c: c.memory["total"])
                out.append(f"  {table}: {len(fit)} meshes do not fit; closest {c.mesh_text}: "
                           f"{c.reason[len('does not fit: '):]}")
            if bad:
                out.append(f"  {table}: {len(bad)} meshes do not divide, e.g. {bad[0].mesh_text}: "
                           f"{bad[0].reason[len('does not divide: '):]}")
    return "\n".join(out)
