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

The cost model (per step, per device):

- compute = FLOPs per token x tokens x (1 + recompute share) / (devices x peak FLOP/s);
- collectives, from the plan's placements (rows of ``validate.check``), per microbatch:
  - a parameter sharded over a mesh axis that also splits the tokens (FSDP) is all-gathered
    before use: in the forward and again in the backward when it is a stacked (scanned)
    layer parameter, once otherwise (XLA keeps the forward's copy outside the layer loop);
    its gradient is reduce-scattered over those axes (the layer loop re-gathers in the backward;
    outside it XLA keeps the forward's copy, unless the array is also tensor-sharded). An
    embedding table (first logical axis ``vocab`` or ``position``) is not gathered for its
    lookup: the activations move instead (all-to-all forward and backward), or, when the
    tokens are also split over batch axes the table is not sharded on, one all-to-all, the
    table gathered over those axes and its gradient gathered whole (the table whole, twice
    forward and once backward, when it is also tensor-sharded); over length axes, four
    all-to-alls and two gathers of the table's shard (what XLA's SPMD partitioner does with
    the gather and its scatter-add);
  - a parameter's gradient is all-reduced over the token axes it is not sharded on, once for
    the batch axes and once for the length axes (XLA reduces them separately);
  - a kernel sharded over a mesh axis that does not split the tokens (tensor parallelism)
    costs one all-reduce of the activation it meets (``[tokens, embed]``, or the expert buffer
    for expert kernels) per layer: forward for a kernel that contracts over its sharded axis,
    backward for one that produces it. Sibling kernels with the same logical axes and shape
    (k|v, up|gate) count once when the model fuses them;
  - experts sharded over a token axis (expert parallelism): four all-to-alls of the expert
    buffer per MoE layer (dispatch and combine, forward and backward); the buffer's size is
    the model's own constraint ``[expert, batch, capacity, embed]``;
  - keys and values with ``length`` sharded (sequence parallelism): all-gathered over the
    length axes for the attention, twice forward and twice backward, and their gradients
    reduce-scattered;
  - keys and values with ``length`` on a ring axis (context parallelism, ``CONTEXT_AXES``
    of the rules module when it has them): their blocks pass to a neighbour P-1 times forward
    and backward (collective-permutes that overlap the attention), and the residual stream
    moves into and out of the zig-zag order, forward and backward ((P-1)/P of it each time);
  - a stacked parameter whose ``layers`` dim is sharded (pipeline stages): no tensor-parallel
    all-reduce for that axis; with the schedule the plan reports (I iterations, M
    microbatches), each iteration passes a microbatch's activations to the next stage once
    forward and twice backward (collective-permutes, 3 (I + 1) / M of the step's
    ``[tokens, embed]``), the stage's gradients are all-reduced in every iteration, and
    compute is divided by (1 - the schedule's bubble fraction);
  - loss and norm statistics (a few bytes a token) are not counted.
  The bytes of a collective are its whole buffer over its group (an all-gather's result, a
  reduce-scatter's or all-reduce's operand); ``shardzoo advise --verify`` and the tests
  compare them with the compiled step's HLO.
- link time: a ring over the group's g devices moves (g-1)/g of the buffer (twice for an
  all-reduce) through each device's link; the link is the host's (NVLink, ICI) when every
  device of the group sits in one host (devices laid out row-major over the mesh axes,
  outermost first), the network's otherwise. A collective-permute moves its buffer once.
- overlap: parameter all-gathers and gradient reductions run asynchronously beside compute
  (XLA's latency-hiding scheduler) and only their excess over compute shows; activation
  collectives (tensor-parallel all-reduces, sequence-parallel gathers, expert all-to-alls)
  sit on the critical path and count in full:
  ``step = max(compute, parameter collectives) + activation collectives``.
- MFU = model FLOPs (no recompute) / (step x devices x peak): an upper bound, since compute
  runs at peak in this model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import jax.numpy as jnp

from shardzoo.errors import UserError
from shardzoo.sharding import axes as ax
from shardzoo.sharding import rules as _rules
from shardzoo.sharding.mesh import make_abstract_mesh
from shardzoo.sharding.plan import DEVICE_MEMORY, format_bytes, make_plan, parse_device_memory
from shardzoo.sharding.rules import MESH_AXES, get_rules
from shardzoo.sharding.validate import (
    Activation,
    ShardingValidationError,
    ShardingValidationWarning,
    check,
)

# Mesh axes whose `length` shards run attention as a ring (context parallelism), when the
# rule vocabulary has them.
RING_AXES = tuple(getattr(_rules, "CONTEXT_AXES", ()))
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
SHORT = {"all-gather": "AG", "all-reduce": "AR", "reduce-scatter": "RS", "all-to-all": "A2A",
         "collective-permute": "CP"}


class AdviseError(UserError):
    """A device kind, device count or candidate the user gave to ``advise`` is not usable."""


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator kind: memory, dense bf16 peak, and its links (bytes/s per device, one way)."""

    name: str
    memory: int
    peak_flops: float
    host_bw: float  # within a host (NVLink) or an ICI slice
    network_bw: float  # across hosts (InfiniBand) or slices (DCN)
    per_host: int  # devices that share the fast link
    source: str


# Sources: NVIDIA H100 / H200 / A100 datasheets and DGX H100 / A100 user guides (bf16 dense
# Tensor Core peak; NVLink 900 / 600 GB/s both ways per GPU; one 400 / 200 Gb/s InfiniBand
# adapter per GPU); Google Cloud TPU v5p / v5e system-architecture pages (bf16 peak, HBM,
# ICI 4800 / 1600 Gbps per chip, pod slices of 8960 / 256 chips). DCN per chip is an
# assumption (a host's ~100-200 Gb/s shared by its 4 chips), stated as such.
DEVICES = {
    "h100": Device("h100", int(DEVICE_MEMORY["h100"]), 989e12, 450e9, 50e9, 8,
                   "H100 SXM: 989 TFLOP/s bf16 dense, NVLink4 450 GB/s/dir, 400 Gb/s IB per GPU"),
    "h200": Device("h200", int(DEVICE_MEMORY["h200"]), 989e12, 450e9, 50e9, 8,
                   "H200 SXM: 989 TFLOP/s bf16 dense, NVLink4 450 GB/s/dir, 400 Gb/s IB per GPU"),
    "a100": Device("a100", int(DEVICE_MEMORY["a100"]), 312e12, 300e9, 25e9, 8,
                   "A100 SXM 80GB: 312 TFLOP/s bf16 dense, NVLink3 300 GB/s/dir, 200 Gb/s IB per GPU"),
    "v5p": Device("v5p", int(DEVICE_MEMORY["v5p"]), 459e12, 300e9, 6.25e9, 8960,
                  "TPU v5p: 459 TFLOP/s bf16, ICI 4800 Gbps/chip (half one way), 8960-chip pods; "
                  "DCN 6.25 GB/s/chip assumed"),
    "v5e": Device("v5e", int(DEVICE_MEMORY["v5e"]), 197e12, 100e9, 6.25e9, 256,
                  "TPU v5e: 197 TFLOP/s bf16, ICI 1600 Gbps/chip (half one way), 256-chip pods; "
                  "DCN 6.25 GB/s/chip assumed"),
}


def get_device(text, per_host: int | None = None) -> Device:
    """A device kind by name, or a memory size (``80GB``) with H100 compute and links."""
    key = str(text).strip().lower()
    if key in DEVICES:
        dev = DEVICES[key]
    else:
        try:
            label, nbytes = parse_device_memory(text)
        except UserError:
            raise AdviseError(f"--device-memory {text!r}: expected one of {', '.join(DEVICES)} "
                              "or a size like 80GB (sizes take h100's compute and links)") from None
        if key in DEVICE_MEMORY:  # a memory-only kind (v4): no compute or link constants here
            raise AdviseError(f"--device-memory {text!r}: no compute or link constants for it; "
                              f"use one of {', '.join(DEVICES)} or a size like 32GB")
        if nbytes <= 0:
            raise AdviseError(f"--device-memory {text!r}: the size must be positive")
        h = DEVICES["h100"]
        dev = dataclasses.replace(h, name=f"{label} (h100 compute and links)", memory=nbytes)
    if per_host is not None:
        if per_host < 1:
            raise AdviseError(f"--devices-per-host {per_host}: must be at least 1")
        dev = dataclasses.replace(dev, per_host=per_host)
    return dev


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the model (a remat policy): its config, for the plan's activation
    estimate, and the FLOPs per token its backward recomputes."""

    label: str
    config: object
    recompute_flops_per_token: float = 0.0


@dataclasses.dataclass(frozen=True)
class Transfer:
    kind: str
    bytes: float
    axes: tuple[str, ...]
    hides: bool  # parameter traffic that overlaps compute
    what: str


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


def _eff(mesh_axes, sizes) -> tuple[str, ...]:
    return tuple(a for a in mesh_axes if sizes.get(a, 1) > 1)


def _prod(axes_, sizes) -> int:
    return math.prod(sizes[a] for a in axes_)


def _nbytes(row) -> int:
    return math.prod(row.shape) * jnp.dtype(row.dtype).itemsize


def _layer_count(report) -> int:
    for row in report.params:
        if ax.LAYERS in row.names:
            return row.shape[row.names.index(ax.LAYERS)]
    return 1


def _site_repeats(path: str, layers: int) -> int:
    """A constraint recorded inside the scanned layer stack runs once per layer."""
    return layers if "/layers/" in path or path.startswith("activations/layers#") else 1


def collectives(report, sizes: dict, *, fused: bool = True, pipeline: dict | None = None) -> list[Transfer]:
    """The collectives of one microbatch's forward and backward and its gradient reduction,
    from a validated report of params and activation constraints (see the module docstring);
    ``pipeline``: the schedule the plan reports when the rules split the layer stack."""
    acts = report.activations
    resid = next((a for a in acts if ax.BATCH in a.names and ax.EMBED in a.names), None)
    resid = resid or next((a for a in acts if ax.BATCH in a.names), None)
    if resid is None:
        return []

    def dim_axes(row, name):
        return _eff(row.dims[row.names.index(name)].mesh_axes, sizes) if name in row.names else ()

    t_batch, t_len = dim_axes(resid, ax.BATCH), dim_axes(resid, ax.LENGTH)
    tokens = set(t_batch) | set(t_len)
    tok_bytes = _nbytes(resid) / _prod(tokens, sizes)  # [tokens, embed] on one device
    layers = _layer_count(report)
    stage_axes = sorted({a for r in report.params if ax.LAYERS in r.names
                         for a in dim_axes(r, ax.LAYERS)})  # pipeline stages
    expert_buffer = next((a for a in acts if a.names[:1] == (ax.EXPERT,) and ax.EMBED in a.names), None)
    out, seen = [], set()
    for row in report.params:
        names = row.names
        held = {a for d in row.dims for a in _eff(d.mesh_axes, sizes)}
        local = _nbytes(row) / _prod(held, sizes)
        stacked = ax.LAYERS in names
        core = tuple(n for n in names if n != ax.LAYERS)
        lookup = core[:1] in ((ax.VOCAB,), (ax.POSITION,))
        expert_axes = set(dim_axes(row, ax.EXPERT))
        gathered = tuple(a for a in held if a in tokens and a not in expert_axes)
        g = _prod(gathered, sizes)
        model = tuple(a for a in held if a not in tokens and a not in stage_axes)
        unheld = tuple(a for a in sorted(tokens) if a not in held)
        if g > 1 and lookup and _prod(unheld, sizes) > 1 and set(unheld) <= set(t_len):
            out += [Transfer("all-to-all", tok_bytes, gathered, False, f"{row.path} lookup")] * 4
            out += [Transfer("all-gather", local, unheld, True, f"{row.path} lookup")] * 2
        elif g > 1 and lookup and _prod(unheld, sizes) > 1 and _prod(model, sizes) > 1:
            whole = _nbytes(row)  # XLA gathers the table whole, twice forward, once backward
            out += [Transfer("all-gather", whole, tuple(held), True, f"{row.path} lookup")] * 3
        elif g > 1 and lookup and _prod(unheld, sizes) > 1:
            out += [Transfer("all-to-all", tok_bytes, gathered, False, f"{row.path} lookup"),
                    Transfer("all-gather", local, unheld, True, f"{row.path} lookup"),
                    Transfer("all-gather", local * g, gathered, True, f"{row.path} gradient")]
        elif g > 1 and lookup:
            out += [Transfer("all-to-all", tok_bytes, gathered, False, f"{row.path} lookup")] * 2
        elif g > 1:
            twice = stacked or _prod(model, sizes) > 1
            out += [Transfer("all-gather", local * g, gathered, True, row.path)] * (2 if twice else 1)
            out.append(Transfer("reduce-scatter", local * g, gathered, True, row.path))
        # a stage's gradients are reduced in every iteration of the pipeline's loop
        reductions = pipeline["iterations"] if pipeline and stacked else 1
        for part in (t_batch, t_len):
            rest = tuple(a for a in part if a not in held)
            if _prod(rest, sizes) > 1:
                out.append(Transfer("all-reduce", local * reductions, rest, True, f"{row.path} gradient"))
        embed_axes = set(dim_axes(row, ax.EMBED))
        if (_prod(model, sizes) > 1 and ax.EMBED in core and len(core) > 1
                and not embed_axes & set(model)):
            key = (names, row.shape) if fused and ax.EXPERT not in core else row.path
            if key in seen:
                continue
            seen.add(key)
            act = tok_bytes
            if ax.EXPERT in core and expert_buffer is not None:
                buf_axes = {a for d in expert_buffer.dims for a in _eff(d.mesh_axes, sizes)} - set(model)
                act = _nbytes(expert_buffer) / _prod(buf_axes, sizes)
            repeat = layers if stacked else 1
            out.append(Transfer("all-reduce", act * repeat, model, False, f"{row.path} activations"))
    zigzag = False
    for site in acts:
        repeat = _site_repeats(site.path, layers)
        site_axes = {a for d in site.dims for a in _eff(d.mesh_axes, sizes)}
        if site.names[:1] == (ax.EXPERT,) and ax.EMBED in site.names:
            e_axes = dim_axes(site, ax.EXPERT)
            if set(e_axes) & tokens:
                buf = _nbytes(site) / _prod(tokens | set(e_axes), sizes) * repeat
                out += [Transfer("all-to-all", buf, e_axes, False, f"{site.path} dispatch")] * 4
        ring = tuple(a for a in t_len if a in RING_AXES)
        if ax.KV_HEADS in site.names and ax.LENGTH in site.names and ring:
            # ring attention: K and V blocks pass to a neighbour P-1 times forward and again
            # backward, each pass beside a block's attention
            passes = _prod(ring, sizes) - 1
            block = _nbytes(site) / _prod(site_axes, sizes) * repeat * passes
            out += [Transfer("collective-permute", block, ring, True, f"{site.path} ring")] * 4
            if not zigzag:  # the zig-zag order that balances causal work: the residual stream
                zigzag = True  # in and out of it, forward and backward, (P-1)/P of it each time
                moved = tok_bytes * passes / (passes + 1)
                out += [Transfer("collective-permute", moved, ring, False, "zig-zag order")] * 8
        elif ax.KV_HEADS in site.names and ax.LENGTH in site.names and t_len:
            full = _nbytes(site) / _prod(site_axes - set(t_len), sizes) * repeat
            out += [Transfer("all-gather", full, t_len, False, f"{site.path} keys, values")] * 4
            out += [Transfer("reduce-scatter", full, t_len, False, f"{site.path} gradients")] * 2
    if _prod(stage_axes, sizes) > 1:
        # pipeline: every iteration (and the loop's entry) passes one microbatch's activations
        # to the next stage, once forward and twice backward (activations and cotangents)
        hops = 3 * (pipeline["iterations"] + 1) / pipeline["microbatches"] if pipeline else 2
        out.append(Transfer("collective-permute", tok_bytes * hops, tuple(stage_axes), False,
                            "pipeline stages"))
    return out


def link_seconds(t: Transfer, sizes: dict, device: Device) -> float:
    """Ring time of one transfer over the link its group crosses (module docstring)."""
    g = _prod(t.axes, sizes)
    if g <= 1:
        return 0.0
    order = [a for a in MESH_AXES if a in sizes] + [a for a in sizes if a not in MESH_AXES]
    span = max(math.prod(sizes[b] for b in order[order.index(a):]) for a in t.axes)
    bw = device.host_bw if span <= device.per_host else device.network_bw
    factor = {"all-reduce": 2 * (g - 1) / g, "collective-permute": 1.0}.get(t.kind, (g - 1) / g)
    return t.bytes * factor / bw


@dataclasses.dataclass
class Candidate:
    """One (rule table, mesh, variant, grad accumulation) and what it costs."""

    rules: str
    mesh: dict
    variant: str = ""
    grad_accum: int = 1
    memory: dict | None = None  # per device: params, gradients, optimizer, activations, total
    fits: bool = False
    collective_bytes: dict = dataclasses.field(default_factory=dict)  # per step, by kind
    compute_s: float = 0.0
    hidden_s: float = 0.0  # parameter collectives (overlap compute)
    exposed_s: float = 0.0  # activation collectives (critical path)
    step_s: float = math.inf
    mfu: float = 0.0
    bound: str = ""
    reason: str = ""  # why it lost (filled for all but the winners)
    link: dict = dataclasses.field(default_factory=dict)  # kind -> "host" | "network" | "both"

    @property
    def mesh_text(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "1 device"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["mesh_spec"] = self.mesh_text
        if not math.isfinite(self.step_s):
            d["step_s"] = None
        return d


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


OVERLAP = ("step = max(compute, parameter all-gathers + gradient reductions) + activation "
           "collectives (tensor/sequence/expert); compute at peak")


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
                        c = _cost(rules.name, sizes, variant, accum, plan.totals, rep, device,
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


def _cost(rules_name, sizes, variant, accum, totals, report, device, model_flops, tokens,
          fused, num_devices, pipeline=None) -> Candidate:
    transfers = collectives(report, sizes, fused=fused, pipeline=pipeline)
    bubble = pipeline["bubble_fraction"] if pipeline else 0.0
    by_kind = dict.fromkeys(KINDS, 0.0)
    hidden = exposed = 0.0
    hidden_kind, exposed_kind = dict.fromkeys(KINDS, 0.0), dict.fromkeys(KINDS, 0.0)
    links = {}
    order = [a for a in MESH_AXES if a in sizes]
    for t in transfers:
        by_kind[t.kind] += t.bytes * accum
        secs = link_seconds(t, sizes, device) * accum
        span = max(math.prod(sizes[b] for b in order[order.index(a):]) for a in t.axes)
        where = "host" if span <= device.per_host else "network"
        links[t.kind] = where if links.get(t.kind, where) == where else "both"
        if t.hides:
            hidden += secs
            hidden_kind[t.kind] += secs
        else:
            exposed += secs
            exposed_kind[t.kind] += secs
    recompute = variant.recompute_flops_per_token * tokens
    compute = (model_flops + recompute) / (num_devices * device.peak_flops) / (1 - bubble)
    step = max(compute, hidden) + exposed
    if exposed >= max(compute, hidden):
        k = max(exposed_kind, key=exposed_kind.get)
        bound = f"{k} bound (activations, on the critical path: {exposed:.3g} s)"
    elif hidden > compute:
        k = max(hidden_kind, key=hidden_kind.get)
        bound = f"{k} bound (parameters: {hidden:.3g} s against {compute:.3g} s of compute)"
    else:
        bound = f"compute bound ({compute:.3g} s" + (f", remat {variant.label} recomputes)"
                                                       if recompute else ")")
    return Candidate(
        rules_name, sizes, variant.label, accum, memory=dict(totals), fits=True,
        collective_bytes={k: int(v) for k, v in by_kind.items()}, compute_s=compute,
        hidden_s=hidden, exposed_s=exposed, step_s=step,
        mfu=model_flops / (step * num_devices * device.peak_flops), bound=bound, link=links,
    )


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
