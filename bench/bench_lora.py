"""LoRA against full fine-tuning: the plan of llama3-8b, and the train step's time on this CPU.

1. ``train.program.plan`` of llama3-8b (bf16 compute, remat full, batch 8 x 2048, adamw) on one
   device (rules dp) and on fsdp=8 (rules fsdp, an abstract mesh): per-device bytes of params,
   gradients, optimizer state and activations for full fine-tuning (float32 params, and bf16
   params) and for LoRA rank 16 on q,k,v,o,gate,up,down over a bf16 base (float32 adapters).
2. The Program's own compiled train step (the one ``shardzoo train`` runs, on a packed batch) of
   a hidden-512, 4-layer Llama (bench_transformer.py's), float32, batch 8 x 256: full
   fine-tuning against LoRA rank 16, in interleaved rounds (full, LoRA, full, LoRA, ...);
   medians and their ratio.

    python bench/bench_lora.py [--rounds 5] [--out bench/results/lora.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from program_step import one_device_program, packed_batch, stepper  # noqa: E402

from shardzoo.models import get_config  # noqa: E402
from shardzoo.models.transformer import TransformerConfig  # noqa: E402
from shardzoo.sharding.plan import format_bytes  # noqa: E402
from shardzoo.train.program import plan  # noqa: E402

RANK = 16
STEP_CONFIG = TransformerConfig.from_fields(
    vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
    tie_word_embeddings=False, rms_norm_eps=1e-5,
)
BATCH, LENGTH = 8, 256


def plan_rows(batch: int, seq_len: int) -> list[str]:
    base = get_config("llama3-8b", dtype="bfloat16", remat_policy="full")
    variants = (
        ("full fine-tuning, float32 params", base),
        ("full fine-tuning, bfloat16 params", base.replace(param_dtype="bfloat16")),
        (f"LoRA r={RANK}, bfloat16 base", base.replace(param_dtype="bfloat16", lora_rank=RANK)),
    )
    rows = []
    for mesh, rules in (("data=1", "dp"), ("fsdp=8", "fsdp")):
        for name, config in variants:
            p = plan(config, rules, mesh, batch_size=batch, seq_len=seq_len, device_memory="80GB")
            t = p.totals
            trained = sum(np.prod(r.array.shape) for r in p.params if r.array.path.endswith(("lora_a", "lora_b")))
            trained = trained or t["param_count"]
            verdict = "yes" if p.fits else "no"
            rows.append(f"| {mesh} | {name} | {trained / 1e6:,.1f}M | {format_bytes(t['params'])} | "
                        f"{format_bytes(t['gradients'])} | {format_bytes(t['optimizer'])} | "
                        f"{format_bytes(t['activations'])} | {format_bytes(t['total'])} | {verdict} |")
    return rows


VARIANTS = (  # (row, config): full and LoRA, with scanned layers (the default) and unrolled
    ("full fine-tuning", STEP_CONFIG),
    (f"LoRA r={RANK}", STEP_CONFIG.replace(lora_rank=RANK)),
    ("full fine-tuning, unrolled layers", STEP_CONFIG.replace(scan_layers=False)),
    (f"LoRA r={RANK}, unrolled layers", STEP_CONFIG.replace(lora_rank=RANK, scan_layers=False)),
)


def time_steps(rounds: int) -> tuple[dict, dict, dict]:
    """Wall and CPU seconds (this process, all threads) per step of each variant, and XLA's
    cost analysis of each compiled step."""
    batch = packed_batch(STEP_CONFIG.vocab_size, BATCH, LENGTH)
    runs, costs = {}, {}
    for name, config in VARIANTS:
        program = one_device_program(config, BATCH, LENGTH, lr=1e-4)
        state = program.init(np.asarray(jax.random.PRNGKey(0), np.uint32))
        runs[name] = stepper(program, state, batch)
        runs[name]()  # warm-up (compiled above; first run allocates)
        cost = program.compiled_train_step().cost_analysis()
        costs[name] = cost[0] if isinstance(cost, list) else cost
    wall, cpu = {name: [] for name in runs}, {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu, costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    lines = ["## LoRA against full fine-tuning", "",
             "### The plan of llama3-8b: bf16 compute, remat full, batch 8 x 2048, adamw", "",
             "`python bench/bench_lora.py` (`train.program.plan`, the `Program` that `shardzoo train` "
             f"runs; `shardzoo plan --model llama3-8b --override lora_rank={RANK} --override "
             "param_dtype=bfloat16 --override dtype=bfloat16 --override remat_policy=full "
             "--batch-size 8 --seq-len 2048 --rules fsdp --mesh fsdp=8 --device-memory 80GB` "
             "prints the same). Per device; LoRA adapters stay float32 and are the only params "
             "with gradients and optimizer state; activations are the model's own estimate.", "",
             "| mesh | run | trained params | params | gradients | optimizer | activations | total | fits 80 GB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|",
             *plan_rows(8, 2048), ""]
    times, cpu, costs = time_steps(args.rounds)
    wall = {k: statistics.median(v) for k, v in times.items()}
    cpus = {k: statistics.median(v) for k, v in cpu.items()}
    flops = {k: float(c.get("flops", 0.0)) for k, c in costs.items()}
    moved = {k: float(c.get("bytes accessed", 0.0)) for k, c in costs.items()}
    rows = [f"| {k} | {wall[k]:.3f} | {BATCH * LENGTH / wall[k]:,.0f} | {cpus[k]:.2f} | "
            f"{flops[k] / 1e9:.1f} G | {format_bytes(moved[k])} |" for k, _ in VARIANTS]
    (full, _), (lora, _), (full_u, _), (lora_u, _) = VARIANTS

    def ratio(a, b):
        return (f"{wall[a] / wall[b]:.2f}x wall, {cpus[a] / cpus[b]:.2f}x CPU time, "
                f"{flops[a] / flops[b]:.2f}x XLA's FLOPs")

    lines += [
        f"### Train step on this CPU: hidden 512, 4 layers, batch {BATCH} x {LENGTH}, float32", "",
        f"The Program's compiled step (`bench/program_step.py`: adamw, clipping, schedule, a packed "
        f"batch), full fine-tuning against LoRA r={RANK} on q,k,v,o,gate,up,down (float32 base), "
        f"with scanned (default) and unrolled layers; {args.rounds} interleaved rounds (each row "
        f"once per round) after a warm-up each; medians. Load average at the end: "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; on a shared machine the CPU time "
        f"(this process's threads) is the steadier timing.", "",
        "| step | wall (s) | tokens/s | CPU s (all threads) | XLA FLOPs | XLA bytes accessed |",
        "|---|---:|---:|---:|---:|---:|", *rows, "",
        f"- **LoRA step / full step, scanned layers: {ratio(lora, full)}; unrolled layers: "
        f"{ratio(lora_u, full_u)}** (goal: below 1: no gradient of the base weights, no optimizer "
        f"update of them; the adapters' own matmuls are thin).",
        "- Step times (s): " + "; ".join(f"{k}: " + ", ".join(f"{t:.2f}" for t in v)
                                         for k, v in times.items()) + ".", "",
    ]
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
