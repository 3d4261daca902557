"""A/B of ``Program.generate`` under execution overrides, on bench_decode.py's model (CPU).

Each variant is the same loaded model with its own execution fields (a JSON object per variant,
e.g. ``decode_cache_segments``); interleaved rounds after a warm-up each, medians of wall and CPU
time (all threads) and their ratio to the first variant, and whether every variant's tokens
equal the first's.

    python bench/ab_decode.py '{"one": {"decode_cache_segments": 1}, "auto": {}}' [--batch 16] [--new 128] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_decode import DIMS, hf_model  # noqa: E402
from program_step import cpu_model  # noqa: E402

from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.train.io.hf_io import load_hf  # noqa: E402
from shardzoo.train.program import Program  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", help="JSON: {name: {execution field: value}}; the first is the baseline")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    variants = json.loads(args.variants)
    with tempfile.TemporaryDirectory() as path:
        hf_model(path)
        mesh = make_mesh("data=1", devices=jax.devices()[:1])
        _, config, params = load_hf(path, mesh=mesh, rules="dp")
    prompt = np.random.default_rng(args.batch).integers(1, DIMS["vocab_size"], (args.batch, args.prompt)).astype(np.int32)
    programs = {name: Program(config.replace(**fields), get_rules("dp"), mesh) for name, fields in variants.items()}
    tokens = {name: p.decoding.generate(params, prompt, max_new_tokens=args.new) for name, p in programs.items()}
    base = next(iter(programs))
    wall, cpu = {n: [] for n in programs}, {n: [] for n in programs}
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name, program in programs.items():
            t, c = time.perf_counter(), time.process_time()
            program.decoding.generate(params, prompt, max_new_tokens=args.new)
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    print(f"batch {args.batch}, {args.prompt} + {args.new} tokens, {args.rounds} rounds, {cpu_model()}, "
          f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    for name in programs:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"{name}: wall {w:.3f} s ({statistics.median(wall[base]) / w:.3f}x), CPU {c:.3f} s "
              f"({statistics.median(cpu[base]) / c:.3f}x), tokens equal {bool((tokens[name] == tokens[base]).all())}")


if __name__ == "__main__":
    main()
