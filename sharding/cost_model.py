"""The cost model of ``shardzoo advise``: devices, the collectives a placement implies, link
times and a candidate's step time (``advise.py`` enumerates and ranks the candidates).

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
import math

import jax.numpy as jnp

from shardzoo.errors import UserError
from shardzoo.sharding import axes as ax
from shardzoo.sharding import rules as _rules
from shardzoo.sharding.plan import DEVICE_MEMORY, parse_device_memory
from shardzoo.sharding.rules import MESH_AXES

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
# adapter per GPU); Google Cloud TPU v5p / v5e / v4 system-architecture pages (bf16 peak, HBM,
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
    "v4": Device("v4", int(DEVICE_MEMORY["v4"]), 275e12, 150e9, 6.25e9, 4096,
                 "TPU v4: 275 TFLOP/s bf16, ICI 2400 Gbps/chip (half one way), 4096-chip pods; "
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
class Transfer:
    kind: str
    bytes: float
    axes: tuple[str, ...]
    hides: bool  # parameter traffic that overlaps compute
    what: str


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


OVERLAP = ("step = max(compute, parameter all-gathers + gradient reductions) + activation "
           "collectives (tensor/sequence/expert); compute at peak")


def step_cost(rules_name, sizes, variant, accum, totals, report, device, model_flops, tokens,
          fused, num_devices, pipeline=None) -> Candidate:
    """A fitting candidate's step time, MFU and what bounds it, from its collectives (module
    docstring): ``totals`` its plan's memory, ``report`` its validated placements."""
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
