"""Train-step throughput of shardzoo's Llama against Hugging Face transformers, on one CPU device.

shardzoo's rows time the program's own step (``train/program.py``, the one ``shardzoo train``
runs, on a packed data-contract batch: ``bench/program_step.py``). Interleaved A/B rounds in one process (JAX step, then torch step, repeated), medians and their
ratio; the matmul peak (jnp.dot 2048x2048 float32) measured in the same process; model FLOP/s
as a fraction of it; and the compile time of the scanned train step at 2 vs 32 layers.
Prints a markdown section (redirect it to bench/results/transformer.md).

    python bench/bench_transformer.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import plain_llama  # noqa: E402
from program_step import cpu_model, one_device_program, packed_batch, stepper  # noqa: E402

from shardzoo.models.transformer import TransformerConfig  # noqa: E402

CONFIG = TransformerConfig.from_fields(
    vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
    tie_word_embeddings=False, rms_norm_eps=1e-5,
)
BATCH, LENGTH, LR = 8, 256, 1e-4


def jax_program(config: TransformerConfig):
    """The Program of ``shardzoo train`` for ``config`` at BATCH x LENGTH, adamw at LR, one device."""
    return one_device_program(config, BATCH, LENGTH, lr=LR)


def torch_train_step(config: TransformerConfig):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(2)
    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=False,
        rms_norm_eps=config.rms_norm_eps,
    )
    model = LlamaForCausalLM(hf).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(tokens):
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step, torch.from_numpy


def matmul_peak(reps: int = 10) -> float:
    """FLOP/s of a jitted float32 2048x2048 jnp.dot (median of ``reps``)."""
    n = 2048
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dot(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def compile_seconds(layers: int) -> float:
    """Lower + compile of the scanned train step at ``layers`` layers (abstract inputs)."""
    program = jax_program(CONFIG.replace(num_hidden_layers=layers))
    t = time.perf_counter()
    program.compiled_train_step()
    return time.perf_counter() - t


PLAIN = "plain JAX, hand-written (bench/plain_llama.py)"
FLOOR = "plain JAX without attention (a floor, not a model)"
HF = "HF LlamaForCausalLM (torch)"


def _runner(step, state, tokens):
    """A no-argument callable running one step of a jitted JAX ``step`` to completion."""
    params, opt_state = state

    def run():
        nonlocal params, opt_state
        params, opt_state, loss = step(params, opt_state, tokens)
        loss.block_until_ready()

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    tokens_np = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (BATCH, LENGTH + 1))
    tokens = jnp.asarray(tokens_np, jnp.int32)
    batch = packed_batch(CONFIG.vocab_size, BATCH, LENGTH)  # shardzoo's step: the data contract
    runs = {}  # name -> one step, run to completion
    for name, config in [
        ("shardzoo (JAX), scanned layers: the default", CONFIG),
        ("shardzoo, unrolled layers", CONFIG.replace(scan_layers=False)),
        ("shardzoo, fuse_projections=false (before)", CONFIG.replace(fuse_projections=False)),
    ]:
        program = jax_program(config)
        runs[name] = stepper(program, program.init(jax.random.key(0)), batch)
    for name, attention in [(PLAIN, True), (FLOOR, False)]:
        step, init = plain_llama.train_step(CONFIG, LR, attention)
        runs[name] = _runner(step, jax.jit(init)(jax.random.key(0)), tokens)
    torch_step, to_torch = torch_train_step(CONFIG)
    tokens_t = to_torch(tokens_np.astype(np.int64))
    runs[HF] = lambda: torch_step(tokens_t)

    for run in runs.values():  # warm-up (compiles the JAX steps)
        run()
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)

    peak = matmul_peak()
    compile_2, compile_32 = compile_seconds(2), compile_seconds(32)

    import torch
    import transformers

    tokens_per_step = BATCH * LENGTH
    flops_per_step = CONFIG.flops_per_token(LENGTH) * tokens_per_step
    median = {name: statistics.median(t) for name, t in times.items()}
    ours = next(iter(median))  # the first row: the default
    print("## Transformer train step (CPU, one device)\n")
    print(f"Llama: hidden {CONFIG.hidden_size}, intermediate {CONFIG.intermediate_size}, "
          f"{CONFIG.num_hidden_layers} layers, {CONFIG.num_attention_heads} heads / "
          f"{CONFIG.num_key_value_heads} kv heads, vocab {CONFIG.vocab_size}, untied, "
          f"{CONFIG.num_params() / 1e6:.1f}M params; batch {BATCH} x length {LENGTH}, float32, AdamW, "
          f"remat none. {args.rounds} interleaved rounds (every row once per round) after one "
          "warm-up each; medians. The shardzoo rows time the step `shardzoo train` runs "
          "(`run_program`'s compiled step: adamw with its defaults, clipping and schedule, on a "
          "packed batch of two documents per row with loss weights; bench/program_step.py); "
          "the plain JAX and HF rows a plain next-token step.\n")
    print(f"Machine: {cpu_model()}, {os.cpu_count()} CPUs, "
          f"load average at the end {os.getloadavg()[0]:.1f}; jax {jax.__version__}, "
          f"torch {torch.__version__} (2 threads), transformers {transformers.__version__}.\n")
    print("| | step (s) | tokens/s | model FLOP/s | of matmul peak | vs HF |")
    print("|---|---|---|---|---|---|")
    for name, sec in median.items():
        flops = flops_per_step / sec
        print(f"| {name} | {sec:.3f} | {tokens_per_step / sec:,.0f} | {flops / 1e9:.1f} G | "
              f"{flops / peak:.0%} | {median[HF] / sec:.2f}x |")
    print(f"\n- Speed-up of the default over HF: **{median[HF] / median[ours]:.2f}x** (goal >= 1.2x); "
          f"over the hand-written plain JAX step: {median[PLAIN] / median[ours]:.2f}x; the plain step "
          f"without any attention is {median[HF] / median[FLOOR]:.2f}x HF.")
    print("- Step times (s), by row: " + "; ".join(
        f"{i}: {', '.join(f'{t:.2f}' for t in ts)}" for i, ts in enumerate(times.values(), 1)) + ".")
    print(f"- Matmul peak (jnp.dot 2048x2048 float32): {peak / 1e9:.1f} GFLOP/s; the default's model "
          f"FLOP/s is {flops_per_step / median[ours] / peak:.0%} of it (goal >= 40%). FLOPs/token "
          f"{CONFIG.flops_per_token(LENGTH) / 1e6:.1f}M (6 x matmul params + causal attention, "
          "MaxText's formula).")
    print(f"- Compile (lower + compile) of the scanned train step: {compile_2:.1f} s at 2 layers, "
          f"{compile_32:.1f} s at 32 layers: **{compile_32 / compile_2:.2f}x** (goal <= 1.5x).")


if __name__ == "__main__":
    main()
