"""Pipeline parallelism (preset ``pp``) on 8 fake CPU devices: per-device memory at stage = 1, 2,
4 (the plan beside XLA's compiled figures) and the step time against the analytic bubble.

llama-tiny widened (hidden 128, intermediate 256, 8 layers), global batch 32 x 128 tokens,
float32, adamw: the step ``shardzoo train`` runs (``run_program(...).compile_report()`` and its
compiled step), on mesh ``stage=S,data=8/S`` with rules ``pp``.

Time: every iteration of the schedule computes on every stage, the idle ones on stale values
(models/pipeline.py), so with the 8 fake devices sharing the CPU's cores a step costs
``iterations x S`` stage-iterations of work: relative to the same model on ``data=8`` (no
pipeline, the same total useful work) the analytic prediction is ``(R*M + S - 1) / (R*M)``, i.e.
``1 / (1 - bubble)``. Rounds are interleaved (every configuration once per round); medians.

    python bench/bench_pipeline.py [--rounds 3] [--out bench/results/pipeline.md]
    python -m bench --only pipeline
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

DEVICES = 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from program_step import packed_batch, stepper  # noqa: E402
from report import write_section  # noqa: E402  (bench/report.py)

from shardzoo.models import get_model  # noqa: E402
from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.sharding.plan import format_bytes  # noqa: E402
from shardzoo.train.config import TrainConfig  # noqa: E402
from shardzoo.train.tasks.registry import run_program  # noqa: E402

SIZE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8}
# (stages, microbatches, repeats); stages 1 is the model without a pipeline (rules pp on data=8).
MEMORY = ((1, 0, 1), (2, 0, 1), (4, 0, 1))
TIMED = ((1, 0, 1), (4, 4, 1), (4, 8, 1), (4, 16, 1), (4, 4, 2), (4, 8, 2))


def build(stages, microbatches, repeats, batch, seq_len):
    module, config = get_model("llama-tiny", **SIZE, pipeline_microbatches=microbatches,
                               pipeline_repeats=repeats)
    return run_program(TrainConfig(batch_size=batch, seq_len=seq_len), config, get_rules("pp"),
                       make_mesh(f"stage={stages},data={DEVICES // stages}"), module=module)


def memory_rows(batch, seq_len) -> list[str]:
    rows = []
    for stages, m, r in MEMORY:
        program = build(stages, m, r, batch, seq_len)
        plan, report = program.plan(name="llama-tiny"), program.compile_report()
        p, x = plan.totals, report["memory"]
        pipe = plan.pipeline
        sched = "-" if pipe is None else f"M={pipe['microbatches']}, R={pipe['repeats']}"
        rows.append(
            f"| {stages} | {sched} | {format_bytes(p['params'])} | "
            f"{format_bytes(p['params'] + p['optimizer'])} | {format_bytes(x['argument'] - report['batch_bytes'])} | "
            f"{format_bytes(p['activations'])} | {format_bytes(p['total'])} | {format_bytes(x['total'])} | "
            f"{p['total'] / x['total']:.2f} |")
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def time_rows(batch, seq_len, rounds) -> tuple[list[str], list[str]]:
    runs, plans = {}, {}
    data = packed_batch(512, batch, seq_len)
    for case in TIMED:
        program = build(*case, batch, seq_len)
        plans[case] = program.plan(name="llama-tiny")
        run = stepper(program, program.init(jax.random.key(0)), data)
        run()  # compile and warm up
        runs[case] = run
    times = {case: [] for case in TIMED}
    for _ in range(rounds):
        for case, run in runs.items():
            start = time.perf_counter()
            run()
            times[case].append(time.perf_counter() - start)
    base = statistics.median(times[TIMED[0]])
    rows = []
    for case in TIMED:
        med = statistics.median(times[case])
        pipe = plans[case].pipeline
        if pipe is None:
            rows.append(f"| 1 (data=8) | - | - | - | - | {med:.3f} | 1.00 | 1.00 | |")
            continue
        s, m, r = pipe["stages"], pipe["microbatches"], pipe["repeats"]
        predicted = (r * m + s - 1) / (r * m)
        rows.append(f"| {s} | {m} | {r} | {pipe['iterations']} | {100 * pipe['bubble_fraction']:.1f}% | "
                    f"{med:.3f} | {med / base:.2f} | {predicted:.2f} | {med / base / predicted:.2f} |")
        print(rows[-1], file=sys.stderr, flush=True)
    raw = [f"{'/'.join(map(str, c))}: {', '.join(f'{t:.3f}' for t in times[c])}" for c in TIMED]
    return rows, raw


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="markdown file to write")
    args = parser.parse_args(argv)
    load0 = os.getloadavg()[0]
    mem = memory_rows(args.batch, args.seq_len)
    timed, raw = time_rows(args.batch, args.seq_len, args.rounds)
    load1 = os.getloadavg()[0]
    sizes = ", ".join(f"{k}={v}" for k, v in SIZE.items())
    lines = [
        "## Pipeline parallelism: memory per stage and the bubble (8 fake CPU devices)",
        "",
        f"`python bench/bench_pipeline.py --rounds {args.rounds}` (or `python -m bench --only pipeline`): "
        f"llama-tiny at {sizes}, global batch {args.batch} x {args.seq_len}, float32, adamw, remat none; "
        "the step `shardzoo train` runs (`run_program(...)`), rules `pp` on mesh `stage=S,data=8/S`; "
        f"jax {jax.__version__}; load average {load0:.1f} at the start, {load1:.1f} at the end.",
        "",
        "Per device, the plan (`Program.plan()`) beside XLA's `memory_analysis()` of the compiled step: "
        "XLA argument - batch is the train state one device holds (params + adam mu and nu). "
        "Stage 1 is the model without a pipeline (the layer stack on no mesh axis of size > 1).",
        "",
        "| stages | schedule | plan params | plan params + adam | XLA argument - batch | plan activations "
        "| plan total | XLA total | plan / XLA |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        *mem,
        "",
        f"Step time, {args.rounds} interleaved rounds after a warm-up, medians. `measured` is the step "
        "time over the data=8 step's (the same useful work, no pipeline); `predicted` is "
        "`(R*M + S - 1) / (R*M) = 1 / (1 - bubble)`.",
        "",
        "| stages S | microbatches M | repeats R | iterations | bubble | step (s) | measured | predicted "
        "| measured / predicted |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *timed,
        "",
        "- What the time can show here: the fake devices share the CPU's cores and every stage computes "
        "in every iteration (the idle ones on stale values), so the bubble costs CPU time exactly as it "
        "costs idle device time on real accelerators, and the step time follows the schedule's "
        "iterations. What it cannot show: any real overlap or parallel speed-up of stages, the latency "
        "of collective-permutes over an interconnect, or the per-iteration overheads on an accelerator. "
        "The pipeline also pays here for more, smaller matmuls per microbatch, a loop of "
        "R*M + S - 1 iterations, the embedding and the head computed on every stage (the batch is "
        "replicated over `stage`), and with R > 1 one all-to-all of the layer weights (and their "
        "gradients) per step: the stored layer order is the model's, the circular schedule interleaves it.",
        f"- Raw step times (s), stages/microbatches/repeats (0: one per stage): {'; '.join(raw)}.",
    ]
    report = "\n".join(lines) + "\n"
    write_section(report, args.out, "pipeline.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
