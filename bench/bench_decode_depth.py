"""Decoding's compile time against depth, scanned against unrolled layers, and its speed
against the memory-bandwidth bound.

``Program.generate`` runs a scanned model's layers as ``execution.decode_layers`` says
(``models/decode.py``): "scan" decodes through the layer scan (the program holds one layer
whatever the depth), "unroll" (the default) unrolls every layer. Both rows decode the same
scanned model, the "scanned" one with ``decode_layers="scan"``, the "unrolled" one with
"unroll". For each model and layer count: the seconds ``generate``'s first call takes to
compile (its compile alone), then the fastest of three later calls' tokens/s, and that rate as
a fraction of the bandwidth bound: every step reads the weights once and the whole KV cache
once (``--hbm`` bytes/s; 819e9 is a TPU v5e chip's).

    python bench/bench_decode_depth.py --out bench/results/decode_depth.md      # CPU: tiny llama, 4/8/16 layers
    python bench/bench_decode_depth.py --models llama3.2-1b,qwen3-0.6b --dtype bfloat16 \\
        --batches 1,32 --prompt 128 --new 256 --layers 0                        # one TPU v5e chip

``--layers 0`` keeps each preset's own depth; on the chip drop ``JAX_PLATFORMS`` (the CPU run
sets it to cpu unless it is set).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

if "--models" not in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from shardzoo.models import get_model  # noqa: E402
from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.train.program import Program  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, vocab_size=512, num_attention_heads=4,
            num_key_value_heads=2)


def nbytes(tree) -> int:
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _timed(call) -> float:
    t = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - t


def measure(name: str, overrides: dict, batch: int, prompt_len: int, new: int, hbm: float, profile=None,
            hlo=None) -> dict:
    """Compile seconds, tokens/s and the fraction of the bandwidth bound of one ``generate``;
    ``profile``: a trace directory, where the device time of one more call went (printed);
    ``hlo``: a file the compiled program's text is written to (layouts, copies)."""
    _, config = get_model(name, **overrides)
    program = Program(config, get_rules("dp"), make_mesh("data=1", devices=jax.devices()[:1]))
    params = program.init(np.asarray(jax.random.PRNGKey(0), np.uint32)).params
    prompt = np.random.default_rng(0).integers(1, config.arch.vocab_size, (batch, prompt_len)).astype(np.int32)
    settings = (prompt.shape, new, 0.0, 0, 1.0, (), 0)
    t = time.perf_counter()
    program.decoding._compiled[settings] = program.decoding._compile_generate(*settings)  # what the first call compiles
    compile_s = time.perf_counter() - t
    if hlo:
        with open(hlo, "w") as f:
            f.write(program.decoding._compiled[settings][0].as_text())
    program.decoding.generate(params, prompt, max_new_tokens=new)  # a warm-up run
    times = []
    for _ in range(3):
        t = time.perf_counter()
        program.decoding.generate(params, prompt, max_new_tokens=new)
        times.append(time.perf_counter() - t)
    run_s = min(times)
    # the steps alone: the same call for one new token (the prefill and one step) taken away
    settings = (prompt.shape, 1, 0.0, 0, 1.0, (), 0)
    program.decoding._compiled[settings] = program.decoding._compile_generate(*settings)
    program.decoding.generate(params, prompt, max_new_tokens=1)
    prefill_s = min(_timed(lambda: program.decoding.generate(params, prompt, max_new_tokens=1)) for _ in range(3))
    if profile:
        from profile_ops import profile_ops

        print(profile_ops(lambda: program.decoding.generate(params, prompt, max_new_tokens=new), steps=1,
                          trace_dir=profile, top=80), flush=True)
    cache, _ = program.decoding.cache_shardings(batch, prompt_len + new)
    step_bytes = nbytes(params) + nbytes(cache)
    bound = batch * hbm / step_bytes  # tokens/s if each step only read weights and cache once
    rate = batch * new / run_s  # the prefill included
    step_rate = batch * (new - 1) / (run_s - prefill_s)  # the sampling loop's steps alone
    return dict(layers=config.arch.num_hidden_layers, compile_s=compile_s, rate=rate, of_bound=rate / bound,
                step_rate=step_rate, step_of_bound=step_rate / bound, prefill_ms=prefill_s * 1e3,
                weights_mb=nbytes(params) / 1e6, cache_mb=nbytes(cache) / 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-tiny", help="comma-separated presets")
    parser.add_argument("--layers", default="4,8,16", help="layer counts; 0: the preset's own")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--dtype", default="float32", help="compute and param dtype")
    parser.add_argument("--hbm", type=float, default=819e9, help="memory bandwidth, bytes/s")
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="trace one more call of each row into DIR/ROW and print its device ops (bench/profile_ops.py)")
    parser.add_argument("--hlo", default=None, metavar="DIR", help="write each row's compiled program to DIR/ROW.hlo")
    parser.add_argument("--variants", default="", help="';'-separated execution overrides, a row each, "
                        "e.g. 'decode_new_key_apart=on;decode_new_key_apart=off'")
    parser.add_argument("--scan", default="both", choices=("both", "scan", "unroll"), help="which decoding layers")
    args = parser.parse_args()
    tiny = args.models == "llama-tiny"
    rows = []
    for name in args.models.split(","):
        for layers in (int(n) for n in args.layers.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                for scan, variant in itertools.product({"both": (True, False), "scan": (True,),
                                                        "unroll": (False,)}[args.scan], args.variants.split(";")):
                    overrides = dict(decode_layers="scan" if scan else "unroll", dtype=args.dtype,
                                     param_dtype=args.dtype)
                    overrides.update(kv.split("=", 1) for kv in variant.split(",") if kv)
                    if tiny:
                        overrides.update(TINY, max_position_embeddings=args.prompt + args.new)
                    if layers:
                        overrides["num_hidden_layers"] = layers
                    trace = args.profile and os.path.join(args.profile, f"{name}_{layers}_{batch}_{scan}")
                    hlo = args.hlo and os.path.join(args.hlo, f"{name}_{layers}_{batch}_{scan}.hlo")
                    if hlo:
                        os.makedirs(args.hlo, exist_ok=True)
                    r = measure(name, overrides, batch, args.prompt, args.new, args.hbm, trace, hlo)
                    rows.append(f"| {name} | {r['layers']} | {batch} | {'scanned' if scan else 'unrolled'}"
                                f"{' ' + variant if variant else ''} | "
                                f"{r['compile_s']:.1f} | {r['rate']:,.0f} | {r['of_bound']:.1%} | "
                                f"{r['prefill_ms']:,.1f} | {r['step_rate']:,.0f} | {r['step_of_bound']:.1%} | "
                                f"{r['weights_mb']:,.1f} | {r['cache_mb']:,.1f} |")
                    print(rows[-1], flush=True)
    device = jax.devices()[0]
    lines = [
        "## Decoding: compile time against depth, scanned against unrolled layers", "",
        f"`Program.generate` on one {device.platform} device ({device.device_kind}), random {args.dtype} weights, "
        f"a {args.prompt}-token prompt, {args.new} new tokens (greedy, no early stop). Compile: the first "
        "call's program alone; tokens/s: the fastest of three calls after a warm-up (prefill included); of the bound: against every step "
        f"reading the weights and the whole KV cache once at {args.hbm / 1e9:.0f} GB/s (a CPU's bandwidth is "
        "lower: there the column only compares the two rows).", "",
        "Prefill: the same call for one new token; the steps alone: the other new tokens over the "
        "time the call takes beyond that one.", "",
        "| model | layers | batch | decoding layers | compile (s) | tokens/s | of the bound | prefill + 1 step (ms) | "
        "tokens/s, steps alone | of the bound | weights (MB) | KV cache (MB) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
    ]
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
