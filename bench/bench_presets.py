"""What each sharding preset costs per device, as the compiler sees it, and compile time vs depth.

``--what presets``: llama-tiny and mixtral-tiny under dp, fsdp, tp, fsdp_tp, sp and ep, each on
an 8-device mesh that suits it, compiled ahead of time (``run_program(...).compile_report()``:
the step ``shardzoo train`` runs, with the program's shardings) on fake CPU devices. Per device: XLA's ``memory_analysis`` (arguments, temporaries, total) beside
the planner's estimate, and the collectives in the compiled program. Nothing runs.

``--what depth``: seconds to lower and compile that train step on one device for llama-tiny
at growing depth, with layers scanned (``nn.scan``, the default) and unrolled.

    python bench/bench_presets.py --what presets [--quick] [--out bench/results/presets.md]
    python bench/bench_presets.py --what depth [--quick] [--out bench/results/compile.md]
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
from shardzoo.train.jit import COLLECTIVES  # noqa: E402
from shardzoo.train.tasks.registry import run_program  # noqa: E402

# preset -> 8-device mesh (tensor=2: the tiny models have 2 kv heads; ep: one expert per device
# pair for mixtral-tiny's 4 experts).
MESHES = {
    "dp": "data=8",
    "fsdp": "fsdp=8",
    "tp": "data=4,tensor=2",
    "fsdp_tp": "fsdp=4,tensor=2",
    "sp": "data=2,sequence=2,tensor=2",
    "ep": "fsdp=2,expert=4",
}
MODELS = ("llama-tiny", "mixtral-tiny")
QUICK = {("llama-tiny", "dp"), ("llama-tiny", "fsdp_tp"), ("mixtral-tiny", "ep")}  # --quick's subset
SHORT = {"all-gather": "AG", "all-reduce": "AR", "reduce-scatter": "RS", "all-to-all": "A2A",
         "collective-permute": "CP"}


def compile_train_step(module, config, rules, mesh, batch: int, seq_len: int):
    """``(program, compile_report)``: the train step ``shardzoo train`` runs, compiled."""
    program = run_program(TrainConfig(batch_size=batch, seq_len=seq_len), config, rules, mesh, module=module)
    return program, program.compile_report()


def preset_rows(batch: int, seq_len: int, quick: bool) -> list[str]:
    """One markdown row per (model, preset); ep on a dense model is skipped (no expert axis)."""
    rows = []
    for name in MODELS:
        module, config = get_model(name)
        for rules_name, spec in MESHES.items():
            if rules_name == "ep" and not config.arch.moe:
                continue
            if quick and (name, rules_name) not in QUICK:
                continue
            rules, mesh = get_rules(rules_name), make_mesh(spec)
            start = time.perf_counter()
            program, result = compile_train_step(module, config, rules, mesh, batch, seq_len)
            seconds = time.perf_counter() - start
            estimate = program.plan(name=name)
            m, c = result["memory"], result["collectives"]
            counts = " / ".join(str(c[op]) for op in COLLECTIVES)
            rows.append(
                f"| {name} | {rules_name} | {spec} | {format_bytes(m['argument'])} | "
                f"{format_bytes(m['temp'])} | {format_bytes(m['total'])} | "
                f"{format_bytes(estimate.totals['total'])} | {counts} | {seconds:.1f} |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def presets_report(args) -> list[str]:
    batch, seq_len = args.batch, args.seq_len
    header = " / ".join(SHORT[op] for op in COLLECTIVES)
    lines = [
        "## Sharding presets: per-device memory and collectives (8 fake CPU devices)",
        "",
        f"`python bench/bench_presets.py --what presets{' --quick' if args.quick else ''}`: "
        f"one adamw train step (forward, backward, update; float32) of each model, global batch "
        f"{batch} x {seq_len} tokens (packed-batch fields and loss weights), the step `shardzoo train` "
        f"runs, compiled ahead of time by `run_program(...).compile_report()` on {DEVICES} fake CPU devices, jax {jax.__version__}. Memory per "
        "device from XLA's `memory_analysis()`: arguments (params, adam state, batch), temporaries, "
        "total = arguments + outputs + temporaries - aliased (donated) buffers; the plan column is "
        "`Program.plan()`'s estimate (params + grads + adam + the model's activation estimate). Collectives are op "
        f"counts in the compiled HLO ({header} = "
        + ", ".join(COLLECTIVES)
        + "); the CPU backend lowers reduce-scatter to all-reduce + dynamic-slice, so RS is 0 "
        "here and AR stands for both.",
        "",
        f"| model | rules | mesh | arguments | temp | total | plan estimate | {header} | compile s |",
        "|---|---|---|---:|---:|---:|---:|---|---:|",
        *preset_rows(batch, seq_len, args.quick),
        "",
        "ep applies to mixtral-tiny only (llama-tiny has no expert axis). Sizes are tiny "
        "(llama-tiny: 2 layers, hidden 64, vocab 512; mixtral-tiny: the same with 4 experts, "
        "top-2), so the batch and the replicated small arrays weigh more than they would at scale; "
        "the ratios between presets and the collective counts are the point."
        + (" --quick compiles only " + ", ".join(f"{m} {r}" for m, r in sorted(QUICK)) + "."
           if args.quick else ""),
    ]
    return lines


def depth_report(args) -> list[str]:
    depths = (2, 4) if args.quick else (2, 4, 8, 16, 32)
    batch, seq_len = 8, 64
    mesh, rules = make_mesh("data=1", devices=jax.devices()[:1]), get_rules("dp")
    module, config = get_model("llama-tiny", num_hidden_layers=1)
    compile_train_step(module, config, rules, mesh, batch, seq_len)  # warm-up: not timed
    rows = []
    for depth in depths:
        cells = []
        for scan in (True, False):
            module, config = get_model("llama-tiny", num_hidden_layers=depth, scan_layers=scan)
            start = time.perf_counter()
            compile_train_step(module, config, rules, mesh, batch, seq_len)
            cells.append(time.perf_counter() - start)
        rows.append(f"| {depth} | {cells[0]:.1f} | {cells[1]:.1f} | {cells[1] / cells[0]:.1f}x |")
        print(rows[-1], file=sys.stderr, flush=True)
    return [
        "## Compile time against depth (one CPU device)",
        "",
        f"`python bench/bench_presets.py --what depth{' --quick' if args.quick else ''}`: seconds "
        f"to lower and compile one adamw train step of llama-tiny (hidden 64) at batch {batch} x "
        f"{seq_len} on one CPU device, jax {jax.__version__}, layers scanned (`nn.scan`, the "
        "default) against unrolled (`--override scan_layers=false`). One compile each after "
        "an untimed warm-up compile, no persistent cache.",
        "",
        "| layers | scanned s | unrolled s | unrolled / scanned |",
        "|---:|---:|---:|---:|",
        *rows,
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=("presets", "depth"), default="presets")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--batch", type=int, default=None, help="presets: global batch (default 16)")
    parser.add_argument("--seq-len", type=int, default=None, help="presets: tokens per row (default 128)")
    parser.add_argument("--out", default=None, help="markdown file to write")
    args = parser.parse_args(argv)
    if args.batch is None:
        args.batch = 8 if args.quick else 16
    if args.seq_len is None:
        args.seq_len = 32 if args.quick else 128
    lines = presets_report(args) if args.what == "presets" else depth_report(args)
    report = "\n".join(lines) + "\n"
    write_section(report, args.out, "presets.md" if args.what == "presets" else "compile.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
