"""Where the CPU train step spends its time, against torch, and which XLA:CPU options win it back.

One process, one Llama (bench_transformer.py's: hidden 512, 4 layers, vocab 8192, batch 8 x 256,
float32, adamw), the step ``shardzoo train`` runs (bench/program_step.py), lowered once and
compiled once per XLA:CPU option set (``compiler_options``: the same knobs as ``XLA_FLAGS``, per
compile), every variant from the same initial state; torch's ``LlamaForCausalLM`` step beside
them. Interleaved rounds (every row once per round), medians of wall and CPU seconds per step;
then one traced step of the default and of torch, CPU milliseconds per op class (XLA:CPU's
thunks from a ``jax.profiler`` trace; ``torch.profiler``'s self CPU time by aten op). Each
variant's first losses are checked against the default's (the numbers must not move). glibc's
malloc is set up as ``python -m shardzoo`` sets it (``host_memory``), for both libraries.

With ``--easydel PYTHON`` (an EasyDeL virtual environment's interpreter) each round also runs
bench_easydel.py in a fresh process under it: EasyDeL's own Llama and trainer step at the same
shapes, timed inside that process after its warm-up, so process startup and compilation stay out
of its figures as they do out of the in-process rows'. Its EASYDEL_STEPS timed steps are one
round's median; the in-process rows then also run EASYDEL_STEPS consecutive steps a round, timed
the same way.

    python bench/bench_cpu.py [--rounds 7] [--out bench/results/cpu.md] [--easydel /tmp/edl_venv/bin/python]
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from shardzoo.host_memory import keep_freed_memory  # noqa: E402

KEPT = keep_freed_memory()  # as ``shardzoo train`` runs, before jax starts

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_easydel  # noqa: E402
from bench_transformer import BATCH, CONFIG, LENGTH, jax_program, torch_train_step  # noqa: E402
from profile_ops import summarize_cpu  # noqa: E402
from program_step import cpu_model, packed_batch  # noqa: E402

# name -> XLA:CPU debug options (DebugOptions fields, as XLA_FLAGS would set them)
VARIANTS = {
    "default": {},
    "opt_preset=FAST_RUNTIME": {"xla_cpu_opt_preset": "CPU_OPT_PRESET_FAST_RUNTIME"},
    "prefer_vector_width=512": {"xla_cpu_prefer_vector_width": 512},
    "no YNNPACK fusions (Eigen dots)": {"xla_cpu_experimental_ynn_fusion_type": ""},
    "oneDNN": {"xla_cpu_use_onednn": True},
    "concurrency-optimized scheduler": {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"},
    "loop emitters (no fusion emitters)": {"xla_cpu_use_fusion_emitters": False},
}
EASYDEL = "EasyDeL"
EASYDEL_WARMUP, EASYDEL_STEPS = 2, 3  # per fresh EasyDeL process, i.e. per round
TORCH_CLASSES = (
    (("mm", "bmm", "addmm", "matmul", "linear", "_scaled_dot_product", "_efficient_attention", "_flash"), "matmul"),
    (("copy_", "clone", "contiguous", "t", "transpose", "view", "reshape", "expand", "cat", "slice", "index",
      "to", "_to_copy", "empty", "zeros", "fill_", "as_strided"), "layout: copies, transposes, slices, broadcasts"),
    (("sum", "mean", "max", "amax", "norm", "_foreach_norm"), "reductions"),
    (("embedding", "gather", "scatter", "index_select", "nll_loss", "embedding_dense_backward"), "gather / scatter"),
)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def torch_class(name: str) -> str:
    base = name.removeprefix("aten::")
    for names, cls in TORCH_CLASSES:
        if any(base == n or base.startswith(n + "_backward") for n in names):
            return cls
    return "elementwise and fused ops"


def torch_profile(step, tokens) -> dict[str, float]:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(tokens)
    by = collections.Counter()
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            by[torch_class(e.key)] += e.self_cpu_time_total / 1e3  # us -> ms
    return dict(by)


def lowered_train_step(program):
    """The Program's train step (``Program.compiled_train_step``'s function and shardings), lowered
    once here so that each variant compiles it with its own options."""
    import jax.numpy as jnp

    from shardzoo.sharding.partition import activate, replicated

    scalar = replicated(program.mesh)
    jitted = jax.jit(program._train_fn(), in_shardings=(program.shardings, program.batch_shardings, scalar),
                     out_shardings=(program.shardings, scalar), donate_argnums=0)
    with activate(program.mesh):
        return jitted.lower(program.abstract, program.abstract_batch,
                            jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=scalar))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", default=None, help="comma-separated variant names (default: all)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu.md"))
    parser.add_argument("--easydel", metavar="PYTHON", default=None,
                        help="an EasyDeL environment's python: adds EasyDeL's train step (bench_easydel.py)")
    args = parser.parse_args(argv)
    names = [n for n in VARIANTS if not args.only or n == "default" or n in args.only.split(",")]

    program = jax_program(CONFIG)
    lowered = lowered_train_step(program)
    placed = program.place(packed_batch(CONFIG.vocab_size, BATCH, LENGTH))
    rng = jax.random.PRNGKey(0)
    runs, losses = {}, {}
    for name in names:
        step = lowered.compile(compiler_options=VARIANTS[name])
        box = {"state": program.init(jax.random.key(0))}
        losses[name] = []

        def run(step=step, box=box, name=name):
            box["state"], metrics = step(box["state"], placed, rng)
            losses[name].append(float(metrics["loss"]))

        runs[name] = run
    torch_step, to_torch = torch_train_step(CONFIG)
    tokens_np = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (BATCH, LENGTH + 1))
    tokens_t = to_torch(tokens_np.astype(np.int64))
    runs["transformers (torch)"] = lambda: torch_step(tokens_t)

    for run in runs.values():  # warm-up
        run()
    per_round = EASYDEL_STEPS if args.easydel else 1
    wall = {n: [] for n in [*runs, *([EASYDEL] if args.easydel else [])]}
    cpu = {n: [] for n in wall}
    easydel = None
    for _ in range(args.rounds):
        for name, run in runs.items():
            w, c = [], []
            for _ in range(per_round):
                t0, c0 = time.perf_counter(), cpu_seconds()
                run()
                w.append(time.perf_counter() - t0)
                c.append(cpu_seconds() - c0)
            wall[name].append(statistics.median(w))
            cpu[name].append(statistics.median(c))
        if args.easydel:
            easydel = bench_easydel.run(args.easydel, EASYDEL_WARMUP, EASYDEL_STEPS)
            wall[EASYDEL].append(easydel["wall_s"])
            cpu[EASYDEL].append(easydel["cpu_s"])
    med_wall = {n: statistics.median(v) for n, v in wall.items()}
    med_cpu = {n: statistics.median(v) for n, v in cpu.items()}
    ref = losses["default"]
    moved = {n: max(abs(a - b) for a, b in zip(v, ref, strict=False)) for n, v in losses.items()}

    trace = "/tmp/shardzoo_cpu_trace"
    with jax.profiler.trace(trace):
        runs["default"]()
    ours = summarize_cpu(trace, 1)
    theirs = torch_profile(torch_step, tokens_t)

    import torch

    hf = "transformers (torch)"
    model = cpu_model()
    command = f"python bench/bench_cpu.py --rounds {args.rounds}" + (f" --only {args.only}" if args.only else "")
    if args.easydel:
        command += f" --easydel {args.easydel}"
    lines = [f"`{command}`", "",
             f"CPU: **{model}**, {os.cpu_count()} CPUs (load average at the end {os.getloadavg()[0]:.1f}); "
             f"jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads). Llama hidden "
             f"{CONFIG.hidden_size}, {CONFIG.num_hidden_layers} layers, vocab {CONFIG.vocab_size}, batch {BATCH} x "
             f"{LENGTH}, float32, adamw; {args.rounds} interleaved rounds after a warm-up, medians"
             + (f" (each round's figure the median of {per_round} consecutive steps)" if per_round > 1 else "")
             + f"; glibc's malloc {'keeping freed memory (host_memory)' if KEPT else 'as the environment left it'}."
             + (f" {EASYDEL}: easydel {easydel['easydel']} on jax {easydel['jax']} (its own environment), "
                f"{easydel['attn_mechanism']} attention, a fresh process each round ({EASYDEL_WARMUP} warm-up steps)."
                if easydel else ""), "",
             "| step | wall s | CPU s | vs transformers (CPU s) | vs default (CPU s) | max loss change vs default |",
             "|---|---:|---:|---:|---:|---:|"]
    for n in wall:
        change = f"{moved[n]:.1e}" if n in moved else "-"
        lines.append(f"| {n} | {med_wall[n]:.3f} | {med_cpu[n]:.3f} | {med_cpu[hf] / med_cpu[n]:.2f}x | "
                     f"{med_cpu['default'] / med_cpu[n]:.2f}x | {change} |")
    if easydel:
        per = ", ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(cpu["default"], cpu[EASYDEL], strict=True))
        lines += ["", f"shardzoo's default step against EasyDeL's: **{med_cpu[EASYDEL] / med_cpu['default']:.2f}x** "
                  f"by CPU seconds (issue 39's target: >= 1.2x); CPU s per round, default / EasyDeL: {per}."]
    lines += ["", "CPU milliseconds per step by op class (one traced step; XLA:CPU thunks summed over threads, "
              "torch's self CPU time of aten ops):", "", "| op class | shardzoo (default) | transformers | ratio |",
              "|---|---:|---:|---:|"]
    for cls in sorted(set(ours) | set(theirs), key=lambda c: -ours.get(c, 0)):
        a, b = ours.get(cls, 0.0), theirs.get(cls, 0.0)
        lines.append(f"| {cls} | {a:.1f} | {b:.1f} | {a / b:.2f}x |" if b else f"| {cls} | {a:.1f} | {b:.1f} | - |")
    lines.append(f"| total | {sum(ours.values()):.1f} | {sum(theirs.values()):.1f} | "
                 f"{sum(ours.values()) / max(sum(theirs.values()), 1e-9):.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
