"""Model FLOPs utilization of a ~1B Llama training step on one GPU or TPU chip (bf16).

llama3.2-1b (16 layers, hidden 2048, GQA 32/8 heads of 64, SwiGLU 8192, vocab 128256, tied
embeddings) with bfloat16 compute and float32 parameters, one adamw step per call, jitted on
one device (a GPU with cuDNN attention; a TPU with XLA's attention and, where the float32
params and adam state do not fit its memory, ``--param-dtype bfloat16``). The first (batch, seq, remat) candidate whose compiled step fits the device's memory
(XLA's ``memory_analysis``) is timed: warm-up steps, then ``--steps`` timed steps.

MFU follows MaxText (``calculate_tflops_training_per_device``), as ``TransformerConfig.
flops_per_token`` computes it: 6 x the matmul parameters per token (q, k, v, o, the gated MLP's
three matrices per layer, the vocab projection) plus the causal attention term
(12 * layers * heads * head_dim * seq/2 per token), over the measured step time, against the
dense bf16 peak (989 TFLOP/s for H100/H200 SXM, 197 for a TPU v5e chip). Remat recomputation is not counted (it is
not model work). The step is the program's own (``train/program.py``: the one ``shardzoo
train`` runs, adamw with its clipping and schedule, ``bench/program_step.py``) on a packed
batch of two documents per row with segment ids, positions and loss weights, so the attention
takes the masked branch that training takes.

    python bench/gpu_mfu.py                 # on a GPU; a few minutes including compilation
    python bench/gpu_mfu.py --param-dtype bfloat16 --out bench/results/tpu_mfu.md   # one TPU v5e chip
    python bench/gpu_mfu.py --tiny          # on CPU: a tiny config through the same code path
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # GPU: let the step use the HBM

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/program_step.py
from program_step import one_device_program, packed_batch, stepper  # noqa: E402

from shardzoo.models import get_model  # noqa: E402
from shardzoo.models.costs import POLICY_TERMS  # noqa: E402
from shardzoo.models.execution import REMAT_POLICIES  # noqa: E402
from shardzoo.sharding.plan import first_fit  # noqa: E402
from shardzoo.train.xla_flags import XLA_PRESETS, apply_xla_preset  # noqa: E402

# dense bf16 peaks: SXM GPUs; a TPU v5e chip (jax names it "TPU v5 lite")
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0}
# (batch, seq_len, remat_policy), fastest first; the first that fits is timed.
CANDIDATES = ((8, 4096, "none"), (8, 4096, "save_attn_mlp"), (8, 4096, "full"), (4, 4096, "full"))
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)


def si(x: float) -> str:
    """1.23 T, 45.6 G, 789 M: FLOP counts readable at any scale."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "


def coerce(text: str):
    """``--override`` values: int, float, true/false, else the string."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def device_bytes_limit(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("bytes_limit")


def compile_candidate(model: str, overrides: dict, batch: int, seq_len: int, remat: str, grad_accum: int = 1):
    """``(config, program, bytes the step needs)``: the Program ``shardzoo train`` would run
    (adamw, lr 1e-4, weight decay 0.1; one device; ``batch`` rows a step in ``grad_accum``
    microbatches), its step compiled."""
    _, config = get_model(model, **overrides, remat_policy=remat)
    program = one_device_program(config, batch, seq_len, lr=1e-4, weight_decay=0.1, grad_accum=grad_accum)
    used = program.compile_report()["memory"].get("total")
    return config, program, used


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny config, batch 2 x 64, 1+2 steps, XLA attention: exercises the code on CPU")
    parser.add_argument("--batch", type=int, help="fix the batch (default: try the candidates)")
    parser.add_argument("--seq-len", type=int, help="fix the sequence length")
    parser.add_argument("--remat", help="fix the remat policy (none, save_attn_mlp, full, ...)")
    parser.add_argument("--candidates", default=None, metavar="BxS:REMAT,...",
                        help="the (batch, seq, remat) candidates to try in order, e.g. 4x2048:full,2x2048:full")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="microbatches a step (as `shardzoo train --grad-accum`): the batch is the step's")
    parser.add_argument("--model", default="llama3.2-1b", help="a zoo preset (default: llama3.2-1b)")
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the params' (and so adam's) dtype; compute is bf16 (default: float32)")
    parser.add_argument("--attention", default=None,
                        help="attention_impl (default: cudnn on a GPU, xla with --tiny, else the config's auto)")
    parser.add_argument("--override", action="append", default=[], metavar="K=V",
                        help="a config field (as `shardzoo train --override`), e.g. moe_dispatch=gmm; repeatable")
    parser.add_argument("--policy", action="append", default=[], metavar="NAME=LABEL+LABEL",
                        help="register a remat policy saving these checkpoint names (an ablation of a built-in one, "
                             "e.g. save_qkv_mlp less its splash residuals); use NAME in --candidates")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2; 1 with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 with --tiny)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak (default: by device kind; 989 with --tiny)")
    parser.add_argument("--device-memory", type=float, default=None, metavar="GB",
                        help="memory a step may use (default: the device's allocator limit)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="after the timed steps, trace 2 more into DIR and print where the device time went "
                             "(bench/profile_ops.py)")
    parser.add_argument("--out", default=None, help="markdown file to write (default: bench/results/gpu_mfu[_tiny].md)")
    parser.add_argument("--xla-preset", default=None, choices=tuple(XLA_PRESETS),
                        help="XLA flags added to XLA_FLAGS before JAX starts (train/xla_flags.py; "
                             "`shardzoo train --xla-preset` sets the same; default gpu-overlap on a GPU, "
                             "else none)")
    args = parser.parse_args(argv)
    gpu = not args.tiny and shutil.which("nvidia-smi") is not None  # asked before XLA starts
    args.xla_preset = args.xla_preset or ("gpu-overlap" if gpu else "none")
    xla_flags = apply_xla_preset(args.xla_preset)  # before the first device query starts XLA

    for item in args.policy:
        name, _, labels = item.partition("=")
        REMAT_POLICIES[name] = jax.checkpoint_policies.save_only_these_names(*labels.split("+"))
        POLICY_TERMS[name] = ("block_input", *labels.split("+"))
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    overrides = dict(dtype="bfloat16", param_dtype=args.param_dtype)
    attention = args.attention or ("cudnn" if gpu else "xla" if args.tiny else None)
    if attention:
        overrides["attention_impl"] = attention
    for item in args.override:
        key, _, value = item.partition("=")
        overrides[key.strip()] = coerce(value.strip())
    if args.tiny:
        overrides.update(TINY)
        candidates = [(2, 64, "none")]
    else:
        candidates = list(CANDIDATES)
    if args.candidates:
        candidates = []
        for item in args.candidates.split(","):
            shape, remat = item.split(":")
            b, seq = shape.split("x")
            candidates.append((int(b), int(seq), remat))
    if args.batch or args.seq_len or args.remat:
        b, s, r = candidates[0]
        candidates = [(args.batch or b, args.seq_len or s, args.remat or r)]
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    steps = args.steps if args.steps is not None else (2 if args.tiny else 10)
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in kind), None)
    if peak is None and args.tiny:
        peak = PEAK_BF16_TFLOPS["H200"]
    limit = args.device_memory * 1e9 if args.device_memory else device_bytes_limit(device)

    compiled = {}  # the latest candidate's (config, program, bytes)

    def needed(candidate):
        batch, seq_len, remat = candidate
        compiled.clear()
        t0 = time.perf_counter()
        try:
            compiled[candidate] = compile_candidate(args.model, overrides, batch, seq_len, remat, args.grad_accum)
        except Exception as e:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED while compiling: the next one
            print(f"batch {batch} x {seq_len}, remat {remat}: {str(e).splitlines()[0][:200]}", file=sys.stderr)
            return math.inf
        used = compiled[candidate][2]
        print(f"batch {batch} x {seq_len}, remat {remat}: compiled in {time.perf_counter() - t0:.1f}s, "
              f"{'?' if used is None else f'{used / 1e9:.1f} GB'} of "
              f"{'?' if limit is None else f'{limit / 1e9:.1f} GB'}", file=sys.stderr, flush=True)
        return used

    # the first candidate that compiles and fits all of the device's limit (no limit: any that compiles)
    fit = first_fit(candidates, needed, limit if limit is not None else sys.float_info.max, headroom=0.0)
    if fit.choice is None:
        print("no candidate fits this device", file=sys.stderr)
        return 1
    batch, seq_len, remat = fit.choice
    config, program, _ = compiled[fit.choice]
    run = stepper(program, program.init(jax.random.key(0)), packed_batch(config.vocab_size, batch, seq_len))
    for _ in range(warmup):
        run()
    start = time.perf_counter()
    for _ in range(steps):
        run()
    step_s = (time.perf_counter() - start) / steps
    loss = run.metrics["loss"]
    if not bool(jnp.isfinite(loss)):
        print(f"non-finite loss {float(loss)}", file=sys.stderr)
        return 1

    flops = config.flops_per_token(seq_len) * batch * seq_len  # MaxText's accounting
    mfu = f"{100 * flops / step_s / (peak * 1e12):.3g}%" if peak else "n/a (unknown peak)"
    params_count = sum(x.size for x in jax.tree.leaves(run.state.params))
    label = f"{args.model} (tiny config, code-path check)" if args.tiny else args.model
    if args.override:
        label += " (" + ", ".join(args.override) + ")"
    if args.grad_accum > 1:
        label += f" ({args.grad_accum} microbatches a step)"
    header = ("| model | device | params | batch x seq | attention | remat | step ms | tokens/s | "
              "model FLOP/s | MFU |\n|---|---|---:|---|---|---|---:|---:|---:|---:|")
    line = (f"| {label} | {kind} | {si(params_count)} | {batch} x {seq_len} | "
            f"{overrides.get('attention_impl', 'auto')} | {remat} | {step_s * 1e3:.1f} | {batch * seq_len / step_s:,.0f} | "
            f"{si(flops / step_s)} | {mfu} |")
    notes = (f"bf16 compute, {args.param_dtype} params and adam state; the step `shardzoo train` runs (adamw, packed rows "
             f"of two documents, loss weights); {warmup} warm-up + {steps} timed steps; "
             f"model FLOP per step {si(flops)} (`TransformerConfig.flops_per_token`: 6 x matmul "
             f"params + causal attention)"
             + f"; peak {peak or '?'} TFLOP/s; jax {jax.__version__}; --xla-preset {args.xla_preset}"
             + f" (XLA_FLAGS: {xla_flags or 'none'}).")
    print(header)
    print(line)
    print(notes)
    if args.profile:
        from profile_ops import profile_ops

        notes += "\n\n" + profile_ops(run, steps=2, trace_dir=args.profile, top=40)
        print(notes)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   "gpu_mfu_tiny.md" if args.tiny else "gpu_mfu.md")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        given = list(argv if argv is not None else sys.argv[1:])
        if "--out" in given:  # the command as one would type it, without where the section goes
            del given[given.index("--out"):given.index("--out") + 2]
        f.write(f"`{shlex.join(['python', 'bench/gpu_mfu.py', *given])}`\n\n{header}\n{line}\n\n{notes}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
