"""Context parallelism: per-device memory of a long-context train step at context = 1, 2, 4, 8.

llama-tiny (2 layers, hidden 64, 4 heads / 2 kv heads, vocab 512), one row of ``--seq-len``
tokens (4096), rules ``cp`` on a mesh ``context=N`` of the first N fake CPU devices: XLA's
``memory_analysis()`` of the real train step (``run_program(...).compile_report()``) beside the
plan's estimate (``Program.plan()``, ``models/costs.py``), per device. Only compiled, never run.
Goal: the activations (XLA temp, which also holds the gradients) fall about as 1/N.

    python bench/bench_context.py [--seq-len 4096] [--out bench/results/context.md]
    python -m bench --only context
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


def measure(n: int, seq_len: int, batch: int) -> dict:
    module, config = get_model("llama-tiny")
    mesh = make_mesh(f"context={n}", devices=jax.devices()[:n])
    program = run_program(TrainConfig(batch_size=batch, seq_len=seq_len), config, get_rules("cp"), mesh,
                          module=module)
    plan = program.plan(name="llama-tiny")
    start = time.perf_counter()
    report = program.compile_report()
    return {"n": n, "plan": plan.totals, "xla": report["memory"], "seconds": time.perf_counter() - start,
            "permutes": report["collectives"]["collective-permute"],
            "gathers": report["collectives"]["all-gather"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--out", default=None, help="markdown file to write")
    args = parser.parse_args(argv)
    rows, base = [], None
    for n in map(int, args.sizes.split(",")):
        r = measure(n, args.seq_len, args.batch)
        p, x = r["plan"], r["xla"]
        acts = x["temp"] - p["gradients"]  # XLA's temporaries less the gradients
        base = base or acts
        rows.append(
            f"| {n} | {format_bytes(x['argument'])} | {format_bytes(x['temp'])} | {format_bytes(acts)} | "
            f"{base / acts:.2f} | {format_bytes(p['activations'])} | {p['activations'] / acts:.2f} | "
            f"{format_bytes(x['total'])} | {format_bytes(p['total'])} | {r['permutes']} | {r['gathers']} |")
        print(rows[-1], f"compile {r['seconds']:.1f}s", file=sys.stderr, flush=True)
    lines = [
        "## Context parallelism: per-device memory against the ring size (fake CPU devices)",
        "",
        f"`python bench/bench_context.py --seq-len {args.seq_len}` (or `python -m bench --only context`): "
        f"llama-tiny (2 layers, hidden 64, 4 heads / 2 kv heads), float32, remat none, adamw, global "
        f"batch {args.batch} x {args.seq_len} tokens, rules `cp` on mesh `context=N` (the first N "
        f"devices), jax {jax.__version__}. XLA: `memory_analysis()` of the compiled train step, per "
        "device; activations = XLA temp - gradients (the params' bytes); shrink = N=1's activations "
        "/ this row's (goal: about N); plan = `Program.plan()`'s activation estimate "
        "(`models/costs.py`, ring-aware) and total; ratio = plan / XLA activations.",
        "",
        "| N | XLA argument | XLA temp | XLA activations | shrink | plan activations | ratio | XLA total "
        "| plan total | collective-permutes | all-gathers |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    report = "\n".join(lines) + "\n"
    write_section(report, args.out, "context.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
