"""How long `shardzoo advise` takes, and its collective bytes beside the compiled step's.

1. Speed: the command `shardzoo advise --model llama3-8b --devices 256 --device-memory M`
   over every preset (no --verify), run as a subprocess (imports and JAX start-up included),
   for M = 16GB and h100; the goal is under 60 s. Also the planning time the command reports
   and the number of candidates.
2. The cost model against XLA: llama-tiny and mixtral-tiny under every preset on 8 fake CPU
   devices (batch 16 x 32), estimated collective bytes per step by kind beside the bytes the
   compiled train step's collectives move (``train/advise.py: hlo_collective_bytes``).
3. `shardzoo advise --verify` itself: llama-tiny's top 12 candidates on 8 fake devices, each
   compiled, XLA's memory and bytes over the estimates.

    python bench/bench_advise.py [--quick] [--out bench/results/advise.md]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

DEVICES = 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MESHES = {"dp": "data=8", "fsdp": "data=2,fsdp=4", "tp": "data=4,tensor=2",
          "fsdp_tp": "fsdp=4,tensor=2", "sp": "data=2,sequence=2,tensor=2", "ep": "fsdp=2,expert=4",
          "cp": "data=4,context=2", "cp_fsdp": "fsdp=4,context=2", "pp": "data=4,stage=2"}


def speed(memory: str) -> dict:
    cmd = [sys.executable, "-m", "shardzoo", "advise", "--model", "llama3-8b", "--devices", "256",
           "--device-memory", memory, "--top", "3"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    seconds = time.perf_counter() - start
    head = proc.stdout.splitlines()
    counts = next(line for line in head if "candidates fit" in line)
    top = [line for line in head if line.startswith("#  rules") or line[:2] in ("1 ", "2 ", "3 ")]
    return {"memory": memory, "seconds": seconds, "counts": counts, "top": top,
            "command": " ".join(["shardzoo", *cmd[3:]])}


def versus_compiled(model: str, preset: str) -> dict:
    from shardzoo.models import get_config
    from shardzoo.models.layers import fuses
    from shardzoo.sharding import get_rules, make_mesh
    from shardzoo.sharding.advise import KINDS, collectives
    from shardzoo.train.advise import hlo_collective_bytes
    from shardzoo.train.program import Program, default_optimizer

    config = get_config(model)
    program = Program(config, get_rules(preset), make_mesh(MESHES[preset]),
                      optimizer=default_optimizer(), batch_size=16, seq_len=32)
    sizes = dict(zip(program.mesh.axis_names, program.mesh.axis_sizes, strict=True))
    est = dict.fromkeys(KINDS, 0.0)
    pipeline = getattr(program.plan(), "pipeline", None)
    for t in collectives(program.report, sizes, fused=fuses(config.execution), pipeline=pipeline):
        est[t.kind] += t.bytes
    got = hlo_collective_bytes(program.compiled_train_step().as_text())
    for d in (est, got):
        d["all-reduce"] += d.pop("reduce-scatter")
    return {"model": model, "preset": preset, "est": est, "got": got}


def verified() -> list[str]:
    from shardzoo.models import get_config
    from shardzoo.train.advise import advise_model, verify

    config = get_config("llama-tiny")
    advice = advise_model(config, name="llama-tiny", num_devices=DEVICES, device_memory="1GB",
                          batch_size=16, seq_len=32)
    lines = ["", "`shardzoo advise --model llama-tiny --devices 8 --device-memory 1GB --batch-size 16 "
             "--seq-len 32 --top 12 --verify`: each candidate's compiled step, XLA over the estimate "
             "(memory: the plan's total; collectives: bytes by kind, AR with RS; kinds under 2% of "
             "the step's bytes left out).", "",
             "| # | rules | mesh | memory | all-gather | all-reduce + RS | all-to-all | collective-permute |",
             "|---|---|---|---|---|---|---|---|"]
    for i, v in enumerate(verify(advice, config, 12), 1):
        xla, est = dict(v["collective_bytes"]), dict(v["estimate_bytes"])
        for d in (xla, est):
            d["all-reduce"] += d.pop("reduce-scatter")
        total = sum(xla.values())
        cells = []
        for k in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
            small = max(xla[k], est[k]) < 0.02 * total
            cells.append("-" if small else f"{xla[k] / est[k]:.2f}x" if est[k] else "not estimated")
        memory = v["memory"]["total"] / v["estimate_total"]
        lines.append(f"| {i} | {v['rules']} | {v['mesh']} | {memory:.2f}x | " + " | ".join(cells) + " |")
    return lines


def kb(x) -> str:
    return f"{x / 1e3:,.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="speed only, one device kind")
    parser.add_argument("--out", default=None, help="write the markdown section here")
    args = parser.parse_args(argv)
    from shardzoo.errors import UserError
    from shardzoo.sharding import PRESETS
    runs = [speed(m) for m in (("16GB",) if args.quick else ("16GB", "h100"))]
    lines = ["## `shardzoo advise`: speed, and its collective bytes against the compiled step", "",
             "`python bench/bench_advise.py`. Speed: the whole command as a subprocess (Python and "
             "JAX start-up, one trace of the train state, every preset's meshes x 5 remat "
             "policies x grad accumulation, planned on abstract meshes; no `--verify`) on this "
             "2-core CPU; goal under 60 s.", "",
             "| command | wall s | candidates |", "|---|---:|---|"]
    for r in runs:
        lines.append(f"| `{r['command']}` | {r['seconds']:.1f} | {r['counts'].strip()} |")
    for r in runs:
        lines += ["", f"Top 3 at {r['memory']}:", "", "```", *r["top"], "```"]
    if not args.quick:
        lines += ["", "Collective bytes per step per device (kB, whole buffers; AR includes "
                  "reduce-scatter, which the CPU lowers to all-reduce + slice): the cost model's "
                  "estimate / the compiled train step's HLO, batch 16 x 32, 8 fake CPU devices.", "",
                  "| model | preset | mesh | all-gather | all-reduce + RS | all-to-all | collective-permute |",
                  "|---|---|---|---|---|---|---|"]
        for model in ("llama-tiny", "mixtral-tiny"):
            for preset in (p for p in MESHES if p in PRESETS):
                try:
                    r = versus_compiled(model, preset)
                except UserError as e:  # e.g. a pipeline of MoE layers, which the model refuses
                    lines.append(f"| {model} | {preset} | {MESHES[preset]} | refused: {e} | | | |")
                    continue
                cells = [f"{kb(r['est'][k])} / {kb(r['got'][k])}" for k in
                         ("all-gather", "all-reduce", "all-to-all", "collective-permute")]
                lines.append(f"| {model} | {preset} | {MESHES[preset]} | " + " | ".join(cells) + " |")
    if not args.quick:
        lines += verified()
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
