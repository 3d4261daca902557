"""The plan's per-device memory against XLA's, for the step ``shardzoo train`` runs.

llama-tiny (hidden 256, 4 layers) under every sharding preset and mixtral-tiny (the same
sizes) under ep, global batch 16 x 256 tokens, on 8 fake CPU devices. For each: the plan's
per-device total (``Program.plan()``: params + gradients + optimizer state + the model's
activation estimate, ``models/costs.py``) beside XLA's compiled total of the real train step
(``run_program(TrainConfig(...)).compile_report()``: argument + output + temp - alias), and
their ratio. Nothing runs; each step is compiled once.

    python bench/bench_plan_vs_compiled.py [--quick] [--out bench/results/plan.md]
    python -m bench --only plan
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEVICES = 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from report import write_section  # noqa: E402  (bench/report.py)

from shardzoo.models import get_model  # noqa: E402
from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.sharding.plan import format_bytes  # noqa: E402
from shardzoo.train.config import TrainConfig  # noqa: E402
from shardzoo.train.tasks.registry import run_program  # noqa: E402

# preset -> 8-device mesh, as bench/bench_presets.py (tensor=2: 2 kv heads; ep: expert=4 for
# mixtral-tiny's 4 experts, and for llama-tiny, which has no expert axis, a data axis of 4).
CASES = (
    ("llama-tiny", "dp", "data=8"),
    ("llama-tiny", "fsdp", "fsdp=8"),
    ("llama-tiny", "tp", "data=4,tensor=2"),
    ("llama-tiny", "fsdp_tp", "fsdp=4,tensor=2"),
    ("llama-tiny", "sp", "data=2,sequence=2,tensor=2"),
    ("llama-tiny", "ep", "fsdp=2,expert=4"),
    ("mixtral-tiny", "ep", "fsdp=2,expert=4"),
)
SIZE = {"hidden_size": 256, "num_hidden_layers": 4}
QUICK = {("llama-tiny", "fsdp"), ("mixtral-tiny", "ep")}


def compare(model: str, rules_name: str, mesh_spec: str, batch: int, seq_len: int,
            overrides: dict | None = None) -> dict:
    """The plan's totals and XLA's memory analysis of the real train step, per device."""
    module, config = get_model(model, **(SIZE if overrides is None else overrides))
    program = run_program(TrainConfig(batch_size=batch, seq_len=seq_len), config,
                          get_rules(rules_name), make_mesh(mesh_spec), module=module)
    plan = program.plan(name=model)
    start = time.perf_counter()
    report = program.compile_report()
    seconds = time.perf_counter() - start
    return {"model": model, "rules": rules_name, "mesh": mesh_spec, "plan": plan.totals,
            "xla": report["memory"], "batch_bytes": report["batch_bytes"], "seconds": seconds,
            "estimate": plan.activation_estimate}


def row(r: dict) -> str:
    p, x = r["plan"], r["xla"]
    return (f"| {r['model']} | {r['rules']} | {r['mesh']} | {format_bytes(p['params'])} | "
            f"{format_bytes(p['optimizer'])} | {format_bytes(p['activations'])} | "
            f"{format_bytes(p['total'])} | {format_bytes(x['argument'])} | {format_bytes(x['temp'])} | "
            f"{format_bytes(x['total'])} | {p['total'] / x['total']:.2f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(sorted(map(' '.join, QUICK)))}")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", default=None, help="markdown file to write")
    args = parser.parse_args(argv)
    rows = []
    for model, rules_name, spec in CASES:
        if args.quick and (model, rules_name) not in QUICK:
            continue
        r = compare(model, rules_name, spec, args.batch, args.seq_len)
        rows.append(row(r))
        print(rows[-1], f"compile {r['seconds']:.1f}s", file=sys.stderr, flush=True)
    lines = [
        "## The plan against the compiled train step (8 fake CPU devices)",
        "",
        f"`python bench/bench_plan_vs_compiled.py{' --quick' if args.quick else ''}` "
        "(or `python -m bench --only plan`): per device, the plan's total (`Program.plan()`: "
        "params + gradients (as params) + optimizer state + the model's activation estimate, "
        "`models/costs.py`) against XLA's `memory_analysis()` of the train step `shardzoo train` "
        "runs (`run_program(TrainConfig(batch_size="
        f"{args.batch}, seq_len={args.seq_len}), ...).compile_report()`: adamw, packed-batch "
        "fields, loss weights; total = argument + output + temp - alias), "
        f"models at {', '.join(f'{k}={v}' for k, v in SIZE.items())}, float32, remat none, "
        f"global batch {args.batch} x {args.seq_len}, jax {jax.__version__}. "
        "ratio = plan / XLA; the goal is 0.85 to 1.15.",
        "",
        "| model | rules | mesh | params | optimizer | activations | plan total | XLA argument "
        "| XLA temp | XLA total | ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    report = "\n".join(lines) + "\n"
    write_section(report, args.out, "plan.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
