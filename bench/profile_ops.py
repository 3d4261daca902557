"""Where a compiled step spends its device time: a ``jax.profiler`` trace of a few calls, read
back with ``jax.profiler.ProfileData`` and summed per XLA op and per op category.

    from bench.profile_ops import profile_ops
    print(profile_ops(run, steps=2, trace_dir="/tmp/trace"))   # run(): one step, blocking

The device planes (``/device:TPU:0``, ``/device:GPU:0``) carry an "XLA Ops" line whose events
are the executed HLO ops; their ``hlo_category`` stat (where the backend records it) groups
them (convolution = matmul fusions, custom-call = Pallas kernels, data formatting = copies and
transposes, ...). On a CPU there is no device plane and the summary says so.
"""

from __future__ import annotations

import collections
import glob
import os
import re

import jax


def _stat(event, *names):
    for k, v in event.stats:
        if k in names:
            return v
    return None


def _kind(text: str) -> tuple[str, str]:
    """(op name, category) of an "XLA Ops" event whose name is the HLO instruction's text."""
    name = text.split(" = ", 1)[0].lstrip("%")
    found = re.search(r"[}\])] ([a-z][\w-]*)\(", text)
    opcode = found.group(1) if found else name.split(".")[0]
    if opcode == "fusion":
        kind = re.search(r"kind=k(\w+)", text)
        opcode = {"Output": "fusion: matmul (kOutput)", "Loop": "fusion: elementwise (kLoop)",
                  "Input": "fusion: reduction (kInput)"}.get(kind.group(1) if kind else "", "fusion")
    return name, opcode


_CPU_SKIP = ("ThreadpoolListener", "ThunkExecutor", "end: ", "Wait for", "$")
# an XLA:CPU op's name (HLO instruction name, ``wrapped_`` and numbers stripped) -> its class
_CPU_CLASSES = (
    (("dot", "convolution", "custom-call", "__onednn", "ynn", "xnn", "onednn"), "matmul"),
    (("copy", "transpose", "bitcast", "reshape", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate",
      "pad", "broadcast", "iota"), "layout: copies, transposes, slices, broadcasts"),
    (("reduce", "reduce-window"), "reductions"),
    (("scatter", "gather", "sort"), "gather / scatter"),
    (("fusion", "loop_", "input_"), "elementwise and fused ops"),
    (("exponential", "log", "tanh", "rsqrt", "sqrt", "divide", "multiply", "add", "subtract", "select", "compare",
      "convert", "maximum", "minimum", "negate", "power", "logistic"), "elementwise and fused ops"),
)


def cpu_class(name: str) -> str:
    """The op class of an XLA:CPU thunk's name (``fusion.12``, ``wrapped_broadcast.3``, ``dot.7``)."""
    base = re.sub(r"\.\d+$", "", name.removeprefix("wrapped_"))
    parts = base.split("_")
    for prefixes, cls in _CPU_CLASSES:
        if parts[0] in prefixes or any(base.startswith(p) for p in prefixes if p.endswith("_")):
            return cls
    if base.endswith("fusion"):
        return "elementwise and fused ops"
    return base


def summarize_cpu(trace_dir: str, steps: int) -> dict[str, float]:
    """{op class: CPU milliseconds per step} of the XLA:CPU thunks in the trace (all threads)."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    data = jax.profiler.ProfileData.from_file(files[-1])
    by_cls = collections.Counter()
    for plane in data.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            for ev in line.events:
                if not ev.name.startswith(_CPU_SKIP):
                    by_cls[cpu_class(ev.name)] += ev.duration_ns / 1e6 / steps
    return dict(by_cls)


def summarize(trace_dir: str, steps: int, top: int = 25) -> str:
    """A markdown summary of the device ops in the trace under ``trace_dir`` (loops and calls,
    whose time their body's ops already count, left out)."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not files:
        return f"(no trace under {trace_dir})"
    data = jax.profiler.ProfileData.from_file(files[-1])
    by_op, by_cat, total, shape = collections.Counter(), collections.Counter(), 0.0, {}
    for plane in data.planes:
        if not plane.name.startswith("/device:") or "CPU" in plane.name:
            continue
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            for ev in line.events:
                name, cat = _kind(ev.name)
                if cat in ("while", "call", "conditional"):
                    continue
                ms = ev.duration_ns / 1e6 / steps
                by_op[name] += ms
                by_cat[cat] += ms
                shape.setdefault(name, ev.name.split(" = ", 1)[-1][:90].replace("|", "/"))
                total += ms
    if not total:
        return "(no device 'XLA Ops' line in the trace: " + ", ".join(p.name for p in data.planes) + ")"
    out = [f"device op time per step: {total:.1f} ms", "", "| category | ms/step | share |", "|---|---:|---:|"]
    out += [f"| {c} | {ms:.1f} | {100 * ms / total:.1f}% |" for c, ms in by_cat.most_common()]
    out += ["", "| op | ms/step | share | result |", "|---|---:|---:|---|"]
    out += [f"| {n} | {ms:.2f} | {100 * ms / total:.1f}% | `{shape[n]}` |" for n, ms in by_op.most_common(top)]
    return "\n".join(out)


def profile_ops(run, steps: int = 2, trace_dir: str = "/tmp/shardzoo_trace", top: int = 25) -> str:
    """Trace ``steps`` calls of ``run`` (warm: compiled already) and summarize their device ops."""
    with jax.profiler.trace(trace_dir):
        for _ in range(steps):
            run()
    return summarize(trace_dir, steps, top)
