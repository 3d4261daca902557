"""Run every benchmark, each in its own subprocess and environment, and rewrite BENCHMARKS.md.

    python -m bench                  # all of them (or: python bench/run.py)
    python -m bench --only moe       # one of them; the other sections come from bench/results/
    python -m bench --quick          # smaller sizes, a smoke run: writes bench/results/quick/

Each benchmark writes its markdown section to ``bench/results/NAME.md`` (``transformer``'s is
its stdout); ``bench/results/runs.json`` keeps how each section was made (command, seconds,
exit status, date), so ``--only`` refreshes one section and keeps the others' records. Logs go
to ``bench/results/logs/NAME.log``. BENCHMARKS.md gets the machine, the library versions, the
command of every section, and the sections in order.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VERSIONS = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "torch", "transformers")


@dataclasses.dataclass(frozen=True)
class Bench:
    """One benchmark: ``script`` run with ``args`` (+ ``quick`` under --quick) and ``--out FILE``,
    or, with ``stdout=True``, its stdout saved as the section."""

    name: str
    what: str
    script: str
    args: tuple = ()
    quick: tuple = ()
    stdout: bool = False
    env: tuple = (("JAX_PLATFORMS", "cpu"),)


BENCHES = (
    Bench("transformer", "train-step tokens/s against HF transformers, matmul-peak fraction, compile "
          "time 2 vs 32 layers", "bench_transformer.py", quick=("--rounds", "1"), stdout=True),
    Bench("cpu", "where the CPU train step spends its time by op class against torch (XLA:CPU thunks, "
          "torch.profiler), and XLA:CPU options against the default (interleaved, same initial state)",
          "bench_cpu.py", quick=("--rounds", "1", "--only", "oneDNN")),
    Bench("presets", "per-device memory and collectives per sharding preset, 8 fake devices",
          "bench_presets.py", ("--what", "presets"), ("--quick",)),
    Bench("plan", "the plan's per-device memory against XLA's for the step shardzoo train runs, every "
          "preset, 8 fake devices", "bench_plan_vs_compiled.py", quick=("--quick",)),
    Bench("pipeline", "pipeline parallelism: per-device memory at stage 1, 2, 4 (plan beside XLA) and step "
          "time against the analytic bubble, 8 fake devices", "bench_pipeline.py", quick=("--rounds", "1")),
    Bench("context", "context parallelism: per-device memory of a 4096-token train step at context = "
          "1, 2, 4, 8, plan beside XLA", "bench_context.py", quick=("--seq-len", "1024")),
    Bench("compile", "compile time against depth, scanned vs unrolled", "bench_presets.py",
          ("--what", "depth"), ("--quick",)),
    Bench("moe", "MoE dispatch strategies", "bench_moe.py",
          quick=("--rounds", "2", "--iters", "1", "--length", "128")),
    Bench("lora", "LoRA against full fine-tuning: the plan of llama3-8b, and the train step on this CPU",
          "bench_lora.py", quick=("--rounds", "1")),
    Bench("decode", "sampling throughput of the Program's decoding against transformers' generate, batch "
          "1, 16, 64, 128 new tokens; model FLOP/s of the matmul peak", "bench_decode.py", quick=("--quick",)),
    Bench("decode_depth", "decoding's compile time against depth (4, 8, 16 layers), scanned against unrolled "
          "layers; tokens/s and the fraction of the bandwidth bound", "bench_decode_depth.py",
          quick=("--layers", "2,4", "--new", "8")),
    Bench("mixers", "token mixers (attention, short convolution, Gated DeltaNet, Mamba2): forward+backward "
          "tokens/s of one layer at sequence 512, 2048, 8192", "bench_mixers.py",
          quick=("--lengths", "256,512", "--rounds", "1")),
    Bench("grpo", "GRPO: rollout tokens/s on the training mesh against the standalone decoding, and a step's "
          "time split into sampling, scoring and update", "bench_grpo.py", quick=("--quick",)),
    Bench("distill", "a distillation step (teacher forward + student step; full vocabulary and top-k) against an "
          "SFT step of the same student", "bench_distill.py", quick=("--rounds", "1")),
    Bench("advise", "`shardzoo advise` for llama3-8b on 256 devices, every preset: seconds (goal < 60); "
          "its collective bytes against the compiled step's", "bench_advise.py", quick=("--quick",)),
    Bench("gpu_mfu", "MFU of llama3.2-1b, bf16, cuDNN attention, one GPU", "gpu_mfu.py",
          quick=("--warmup", "1", "--steps", "3"), env=()),
    Bench("gpu_mfu_tiny", "bench/gpu_mfu.py's code path on CPU (tiny config; not a figure)",
          "gpu_mfu.py", ("--tiny",)),
)


def has_gpu() -> bool:
    """An NVIDIA GPU is visible (``nvidia-smi -L`` lists one); decides gpu_mfu vs gpu_mfu_tiny."""
    if not shutil.which("nvidia-smi"):
        return False
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return out.returncode == 0 and "GPU" in out.stdout


def run_one(bench: Bench, results: str, quick: bool, timeout: float) -> dict:
    """Run ``bench`` in a subprocess; return its record for runs.json."""
    out = os.path.join(results, f"{bench.name}.md")
    cmd = [sys.executable, os.path.join(HERE, bench.script), *bench.args, *(bench.quick if quick else ())]
    if not bench.stdout:
        cmd += ["--out", out]
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR")}
    env.update(bench.env)
    shown = shlex.join(["python", os.path.relpath(cmd[1], ROOT), *cmd[2:]]).replace(ROOT + "/", "")
    log_path = os.path.join(results, "logs", f"{bench.name}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    print(f"[{bench.name}] {shown}", flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, text=True,
                                  stdout=subprocess.PIPE if bench.stdout else log, stderr=log)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            proc, code = None, f"timed out after {timeout:.0f}s"
    seconds = time.perf_counter() - start
    if bench.stdout and proc is not None:
        with open(out if code == 0 else log_path, "w" if code == 0 else "a") as f:
            f.write(proc.stdout)
    print(f"[{bench.name}] {'done' if code == 0 else f'FAILED ({code})'} in {seconds:.0f}s", flush=True)
    return {"command": shown, "seconds": round(seconds, 1), "status": code, "quick": quick,
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def machine() -> list[str]:
    """Markdown bullets: CPU model and cores, memory, GPU, OS, Python, library versions."""
    cpu, mem = platform.processor() or platform.machine(), "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
        with open("/proc/meminfo") as f:
            kib = int(next(ln.split()[1] for ln in f if ln.startswith("MemTotal")))
            mem = f"{kib / 2**20:.0f} GiB"
    except OSError:
        pass
    gpus = "none"
    if has_gpu():
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True)
        gpus = "; ".join(q.stdout.strip().splitlines()) or "yes"
    versions = []
    for name in VERSIONS:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    return [
        f"- CPU: {cpu}, {os.cpu_count()} cores; memory {mem}",
        f"- GPU: {gpus}",
        f"- OS: {platform.platform()}; Python {platform.python_version()}",
        f"- Versions: {', '.join(versions)}",
    ]


def gpu_section(results: str, runs: dict) -> str:
    """The GPU MFU section: the GPU run's table, or 'pending' plus the CPU code-path check."""
    path = os.path.join(results, "gpu_mfu.md")
    if "gpu_mfu" in runs and runs["gpu_mfu"]["status"] == 0 and os.path.exists(path):
        with open(path) as f:
            return "## GPU: MFU of llama3.2-1b, bf16, cuDNN attention\n\n" + f.read()
    lines = [
        "## GPU: MFU of llama3.2-1b, bf16, cuDNN attention (pending)",
        "",
        "GPU figures are pending: no GPU has run this suite yet. On a machine with one, "
        "`python -m bench --only gpu_mfu` (or `python bench/gpu_mfu.py`) times 10 adamw steps "
        "of llama3.2-1b (bf16 compute, float32 params, cuDNN attention) after 2 warm-up steps, "
        "at the first of batch x seq 8 x 4096 with remat none / save_attn_mlp / full, then "
        "4 x 4096 full, whose compiled step fits the device's memory, and reports MFU by "
        "MaxText's formula against 989 TFLOP/s (H100/H200 SXM dense bf16).",
    ]
    tiny = os.path.join(results, "gpu_mfu_tiny.md")
    if os.path.exists(tiny) and runs.get("gpu_mfu_tiny", {}).get("status") == 0:
        with open(tiny) as f:
            lines += ["", "The script's code path, run on this CPU with a tiny config "
                      "(`--tiny`: hidden 64, 2 layers, batch 2 x 64, XLA attention); its "
                      "figures mean nothing beyond 'it runs':", "", f.read().strip()]
    return "\n".join(lines) + "\n"


def section(bench: Bench, results: str, runs: dict) -> str:
    record = runs.get(bench.name)
    if record is None:
        return f"## {bench.name}: {bench.what}\n\nNot run yet: `python -m bench --only {bench.name}`.\n"
    if record["status"] != 0:
        log = os.path.join(results, "logs", f"{bench.name}.log")
        tail = open(log).read().strip().splitlines()[-15:] if os.path.exists(log) else []
        return (f"## {bench.name}: {bench.what}\n\nFAILED ({record['status']}) on {record['date']}: "
                f"`{record['command']}`; the end of its log:\n\n```\n" + "\n".join(tail) + "\n```\n")
    with open(os.path.join(results, f"{bench.name}.md")) as f:
        return f.read()


def write_report(path: str, results: str, runs: dict, command: str, load: tuple) -> None:
    lines = [
        "# shardzoo benchmarks",
        "",
        f"Written by `{command}` (bench/run.py) on {datetime.date.today().isoformat()}; rerun it "
        "rather than editing this file. Every benchmark runs in its own subprocess; the table "
        "below gives the command that produced each section.",
        "",
        "## Machine",
        "",
        *machine(),
        f"- Load average (1 min) at the start and end of this run: {load[0]:.1f} / {load[1]:.1f}. "
        "The CPU figures come from a shared machine: the interleaved A/B rounds keep ratios "
        "fair, absolute times are noisy.",
        "",
        "## Sections",
        "",
        "| benchmark | what | command | seconds | status | date |",
        "|---|---|---|---:|---|---|",
    ]
    for b in BENCHES:
        r = runs.get(b.name)
        if r is not None:
            status = "ok" if r["status"] == 0 else f"FAILED ({r['status']})"
            lines.append(f"| {b.name} | {b.what} | `{r['command']}` | {r['seconds']:.0f} | {status} | "
                         f"{r['date']} |")
    body = [section(b, results, runs) for b in BENCHES if not b.name.startswith("gpu_mfu")]
    for name in sorted(n for n in os.listdir(results) if n.startswith("tpu_") and n.endswith(".md")):
        with open(os.path.join(results, name)) as f:  # measured on a lent TPU machine, not by this run
            body.append(f.read())
    body.append(gpu_section(results, runs))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n\n" + "\n".join(body))


def main(argv=None) -> int:
    names = [b.name for b in BENCHES if b.name != "gpu_mfu_tiny"]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes, for a smoke run (writes under bench/results/quick/)")
    parser.add_argument("--only", choices=names, action="append", metavar="NAME",
                        help=f"run only this benchmark (repeatable): {', '.join(names)}")
    parser.add_argument("--output", default=None,
                        help="the report (default: BENCHMARKS.md; bench/results/quick/BENCHMARKS.md with --quick)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark (default 3600)")
    args = parser.parse_args(argv)

    results = os.path.join(HERE, "results", "quick") if args.quick else os.path.join(HERE, "results")
    output = args.output or (os.path.join(results, "BENCHMARKS.md") if args.quick
                             else os.path.join(ROOT, "BENCHMARKS.md"))
    os.makedirs(results, exist_ok=True)
    runs_path = os.path.join(results, "runs.json")
    runs = json.load(open(runs_path)) if os.path.exists(runs_path) else {}
    gpu = has_gpu()
    wanted = set(args.only or names)
    if "gpu_mfu" in wanted and not gpu:  # no GPU here: check the script's code path instead
        wanted = (wanted - {"gpu_mfu"}) | {"gpu_mfu_tiny"}
    command = shlex.join(["python", "-m", "bench", *(argv if argv is not None else sys.argv[1:])])
    load_start = os.getloadavg()[0]
    failed = []
    for bench in BENCHES:
        if bench.name not in wanted:
            continue
        runs[bench.name] = run_one(bench, results, args.quick, args.timeout)
        if runs[bench.name]["status"] != 0:
            failed.append(bench.name)
        with open(runs_path, "w") as f:
            json.dump(runs, f, indent=2)
    write_report(output, results, runs, command, (load_start, os.getloadavg()[0]))
    print(f"wrote {os.path.relpath(output)}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
