"""The TPU table: MFU of the train step for several families on one TPU v5e chip, and what each
piece bought (an ablation row each), every row ``bench/gpu_mfu.py`` in its own process.

    python bench/tpu_mfu.py --out bench/results/tpu_mfu_suite.md              # every row
    python bench/tpu_mfu.py --only llama,ablation-splash --out FILE           # some rows

Each row is a model, its (batch x seq : remat) candidates in order (the first whose compiled
step fits the chip's memory is timed, as ``--remat auto`` picks, less the policies that
``shardzoo plan --device-memory 16.9GB`` already says cannot fit: each failed compile costs chip
time) and config overrides. The
ablation rows switch one piece back to what it was before (XLA attention, the untiled loss,
indexed MoE dispatch, full remat) with everything else as in the main row. Rows are written to
``--out`` as they finish, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (name, model, candidates, overrides)
MOE = ("num_hidden_layers=4", "num_local_experts=32")  # qwen3-30b-a3b's layers, 1.3 B params: fits one chip
ROWS = (
    ("llama", "llama3.2-1b", "2x2048:save_qkv_mlp,4x2048:full", ()),
    ("gemma", "gemma-3-1b", "4x2048:save_qkv,4x2048:full", ()),
    ("qwen", "qwen3-0.6b", "6x2048:save_qkv_mlp,4x2048:save_qkv_mlp", ()),
    ("moe", "qwen3-30b-a3b", "4x2048:save_qkv_mlp,4x2048:save_attn_mlp,2x2048:save_attn_mlp,2x2048:full",
     (*MOE, "moe_dispatch=auto")),
    # each piece switched back alone, everything else as in the llama row (the MoE row for gmm)
    ("ablation-splash", "llama3.2-1b", "2x2048:save_qkv_mlp,2x2048:save_attn_mlp,2x2048:full",
     ("attention_impl=xla",)),
    ("ablation-loss", "llama3.2-1b", "2x2048:save_qkv_mlp,2x2048:save_attn_mlp,2x2048:full", ("tiled_loss=off",)),
    ("ablation-remat", "llama3.2-1b", "4x2048:full", ()),
    ("ablation-residuals", "llama3.2-1b", "2x2048:recompute_kernel",
     ("--policy=recompute_kernel=query+key+value+mlp_gate+mlp_up",)),
    ("llama-bq1024", "llama3.2-1b", "2x2048:save_qkv_mlp", ("splash_block_q=1024",)),
    ("llama-bq2048", "llama3.2-1b", "2x2048:save_qkv_mlp", ("splash_block_q=2048",)),
    ("ablation-gmm", "qwen3-30b-a3b", "4x2048:save_attn_mlp,2x2048:save_attn_mlp,2x2048:full",
     (*MOE, "moe_dispatch=indexed")),
    # the tiled loss's gradients fused into its forward (three head matmuls, not four)
    ("llama-fused", "llama3.2-1b", "2x2048:save_qkv_mlp,2x2048:save_attn_mlp,4x2048:full",
     ("tiled_loss_backward=fused",)),
    ("gemma-fused", "gemma-3-1b", "4x2048:full,2x2048:save_qkv_mlp", ("tiled_loss_backward=fused",)),
    ("qwen-fused", "qwen3-0.6b", "6x2048:save_qkv_mlp,4x2048:save_qkv_mlp", ("tiled_loss_backward=fused",)),
    # the candidates the rows above were chosen from
    # adamw's fixed ~21 ms (6% of a 2 x 2048 step) over two microbatches of 2 x 2048
    ("llama-accum2", "llama3.2-1b", "4x2048:save_qkv_mlp", ("--grad-accum=2",)),
    ("gemma-accum2", "gemma-3-1b", "4x2048:save_qkv_mlp", ("--grad-accum=2",)),
    # MaxText's v5e flag for dense compute-bound models (its xla_flags_library's DENSE_VMEM_LIMIT):
    # more of the chip's on-chip memory for each op, less for prefetching later ops' operands
    ("llama-vmem96", "llama3.2-1b", "2x2048:save_qkv_mlp", ("env:LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=98304",)),
    ("gemma-vmem96", "gemma-3-1b", "2x2048:save_qkv_mlp,4x2048:full",
     ("env:LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=98304",)),
    ("moe-vmem80", "qwen3-30b-a3b", "4x2048:save_attn_mlp,2x2048:save_attn_mlp",
     (*MOE, "moe_dispatch=auto", "env:LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=81920")),
    # the MoE row before its experts' gate and up were kept (save_attn_mlp, as the fifth session ran it)
    ("ablation-moe-qkv", "qwen3-30b-a3b", "4x2048:save_attn_mlp", (*MOE, "moe_dispatch=auto")),
    # gemma at full remat, the row before save_qkv
    ("ablation-gemma-qkv", "gemma-3-1b", "4x2048:full", ()),
    ("llama-attn", "llama3.2-1b", "3x2048:save_qkv,2x2048:save_qkv_mlp", ()),
    # the tiled loss's vocabulary chunks cut from the tied embedding in place, not copied into strided chunks
    ("llama-contiguous", "llama3.2-1b", "2x2048:save_qkv_mlp", ("loss_vocab_chunks=contiguous",)),
    # the MLP's gate kept, its up projection recomputed: save_qkv_mlp's speed at a batch between
    ("gemma-gate3", "gemma-3-1b", "3x2048:save_qkv_mlp,3x2048:save_qkv_gate,4x2048:save_qkv",
     ("--policy=save_qkv_gate=query+key+value+attn_kernel+mlp_gate",)),
    ("llama-qkv", "llama3.2-1b", "4x2048:save_qkv_mlp,3x2048:save_qkv_mlp,2x2048:save_qkv_mlp", ()),
    ("gemma-qkv", "gemma-3-1b", "3x2048:save_qkv_mlp,2x2048:save_qkv_mlp", ()),
    ("qwen-qkv", "qwen3-0.6b", "8x2048:save_qkv_mlp,6x2048:save_qkv_mlp,4x2048:save_qkv_mlp", ()),
    ("llama-none", "llama3.2-1b", "2x2048:none,1x2048:none", ()),
    ("llama-b8", "llama3.2-1b", "8x2048:full", ()),
    ("gemma-b8", "gemma-3-1b", "8x2048:full", ()),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated row names (default: all)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "tpu_mfu_suite.md"))
    parser.add_argument("--timeout", type=float, default=420, help="seconds a row may take")
    parser.add_argument("--steps", default="10", help="timed steps per row")
    parser.add_argument("--override", action="append", default=[], metavar="NAME:K=V",
                        help="add K=V to row NAME's overrides (e.g. moe:moe_dispatch=gmm)")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    extra: dict[str, list[str]] = {}
    for item in args.override:
        name, _, kv = item.partition(":")
        extra.setdefault(name, []).append(kv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    lines = []
    for name, model, candidates, overrides in ROWS:
        if only and name not in only:
            continue
        cmd = [sys.executable, os.path.join(HERE, "gpu_mfu.py"), "--model", model, "--param-dtype", "bfloat16",
               "--candidates", candidates, "--steps", args.steps, "--out", f"/tmp/tpu_mfu_{name}.md"]
        env = dict(os.environ)
        for kv in (*overrides, *extra.get(name, ())):
            if kv.startswith("env:"):  # the row's process environment (libtpu's flags)
                key, _, value = kv[4:].partition("=")
                env[key] = f"{env.get(key, '')} {value}".strip()
                continue
            cmd += [kv] if kv.startswith("--") else ["--override", kv]  # a flag of gpu_mfu's, else a field
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            out, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, code = f"{e.stdout or ''}{e.stderr or ''}", "timeout"
        seconds = time.perf_counter() - start
        print(f"== {name} ({seconds:.0f}s, exit {code})\n{out}", flush=True)
        row = next((ln for ln in out.splitlines() if ln.startswith("| ") and "model |" not in ln), None)
        at = cmd.index("--out")  # the command as one would type it, without where the row goes
        shown = " ".join([*(f"{k}={v!r}" for k, v in env.items() if os.environ.get(k) != v),
                          "python bench/gpu_mfu.py", *cmd[2:at], *cmd[at + 2:]])
        lines.append(f"| {name} | {row or f'failed ({code})'} | `{shown}` |")
        with open(args.out, "w") as f:
            f.write("| row | result (model, device, params, batch x seq, attention, remat, step ms, tokens/s, "
                    "model FLOP/s, MFU) | command |\n|---|---|---|\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
