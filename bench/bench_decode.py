"""Sampling throughput of the Program's compiled decoding against transformers' ``generate``.

One random Llama (hidden 512, intermediate 1408, 4 layers, 8 heads / 4 kv heads, vocab 8192,
untied: bench_transformer.py's) is built with transformers and saved with ``save_pretrained``;
shardzoo loads that directory (``train.hf_io.load_hf``), so both libraries run the same weights.
For batch 1, 16 and 64, a 32-token prompt continued by 128 new tokens, greedy (and, at batch
16, sampled at temperature 1 with top-k 50 and top-p 0.9): ``Program.generate`` (prefill and
the sampling loop in one compiled program, ``models/decode.py``) against
``LlamaForCausalLM.generate`` (torch CPU, its KV cache, one thread: on a shared machine torch's
OpenMP threads wait on each other, two threads ran 5x slower than one here), in interleaved rounds (shardzoo, transformers, shardzoo, ...) after a warm-up each;
medians and their ratio, in wall time and in CPU time (all of the process's threads: the
fairer measure where the two use different thread counts). Model FLOPs per generated token: 2 x matmul params + q.k and probs.v
over the keys it attends (``models.costs.decode_flops``); their rate as a fraction of the
matmul peak (jnp.dot 2048x2048 float32) measured in the same run. Greedy tokens are compared
with transformers' (the same model, so they must agree). glibc's malloc is set up as ``python -m
shardzoo`` sets it (``host_memory``), for both libraries.

    python bench/bench_decode.py [--rounds 3] [--quick] [--out bench/results/decode.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shardzoo.host_memory import keep_freed_memory  # noqa: E402

KEPT = keep_freed_memory()  # as ``shardzoo generate`` runs, before jax starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from program_step import cpu_model  # noqa: E402

from shardzoo.models.costs import decode_flops  # noqa: E402
from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.train.io.hf_io import load_hf  # noqa: E402
from shardzoo.train.program import Program  # noqa: E402

DIMS = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
            tie_word_embeddings=False, rms_norm_eps=1e-5)
SAMPLED = dict(temperature=1.0, top_k=50, top_p=0.9)


def matmul_peak(reps: int = 10) -> tuple[float, float]:
    """FLOP per wall second and per CPU second (all threads) of a jitted float32 2048x2048
    jnp.dot (medians of ``reps``)."""
    n = 2048
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    times, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        dot(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return 2 * n**3 / statistics.median(times), 2 * n**3 / statistics.median(cpu)


def hf_model(path: str):
    """A random LlamaForCausalLM saved at ``path`` (weights wide enough for varied tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**DIMS)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    return model


def runners(path: str, model, batch: int, prompt_len: int, new: int, sampled: bool):
    """(shardzoo, transformers): no-argument callables returning the tokens [batch, prompt + new]."""
    import torch

    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    rules = get_rules("dp")
    _, config, params = load_hf(path, mesh=mesh, rules="dp")
    program = Program(config, rules, mesh)
    prompt = np.random.default_rng(batch).integers(1, DIMS["vocab_size"], (batch, prompt_len)).astype(np.int32)
    settings = SAMPLED if sampled else {}
    hf_settings = dict(do_sample=True, **SAMPLED) if sampled else \
        dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    prompt_t = torch.from_numpy(prompt.astype(np.int64))

    def ours():
        return program.decoding.generate(params, prompt, max_new_tokens=new, **settings)

    def theirs():
        with torch.no_grad():
            return model.generate(prompt_t, attention_mask=torch.ones_like(prompt_t), max_new_tokens=new,
                                  min_new_tokens=new, eos_token_id=None, pad_token_id=0,
                                  **hf_settings).numpy()

    return config, ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="batch 1 and 4, 16 new tokens, one round")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch
    import transformers

    torch.set_num_threads(1)
    batches, new, prompt_len = ((1, 4), 16, 8) if args.quick else ((1, 16, 64), 128, 32)
    rounds = 1 if args.quick else args.rounds
    cases = [(b, False) for b in batches] + [(batches[1], True)]
    load_start = os.getloadavg()[0]
    peak, peak_cpu = matmul_peak()
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as path:
        model = hf_model(path)
        for batch, sampled in cases:
            config, ours, theirs = runners(path, model, batch, prompt_len, new, sampled)
            t = time.perf_counter()
            got = ours()  # warm-up: compiles
            compile_s = time.perf_counter() - t
            want = theirs()
            times = {"ours": [], "theirs": []}
            cpu = {"ours": [], "theirs": []}
            for _ in range(rounds):
                for name, run in (("ours", ours), ("theirs", theirs)):
                    best = None
                    for threads in (1, 2) if name == "theirs" else (None,):  # torch at its better count
                        if threads:
                            torch.set_num_threads(threads)
                        t, c = time.perf_counter(), time.process_time()
                        run()
                        took = (time.perf_counter() - t, time.process_time() - c)
                        best = took if best is None or took[0] < best[0] else best
                    times[name].append(best[0])
                    cpu[name].append(best[1])
            med = {k: statistics.median(v) for k, v in times.items()}
            med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
            tokens = batch * new
            context = prompt_len + (new - 1) / 2  # keys a new token attends, on average
            flops = decode_flops(config.arch, context) * tokens
            same = "sampled" if sampled else f"{np.mean(got[:, prompt_len:] == want[:, prompt_len:]):.0%}"
            what = "sampled (T 1, top-k 50, top-p 0.9)" if sampled else "greedy"
            rows.append(f"| {batch} | {what} | {med['ours']:.2f} | {tokens / med['ours']:,.0f} | "
                        f"{med['theirs']:.2f} | {tokens / med['theirs']:,.0f} | "
                        f"**{med['theirs'] / med['ours']:.2f}x** | {med_cpu['ours']:.2f} | "
                        f"{med_cpu['theirs']:.2f} | {med_cpu['theirs'] / med_cpu['ours']:.2f}x | "
                        f"{flops / med['ours'] / 1e9:.1f} G | {flops / med['ours'] / peak:.0%} | "
                        f"{flops / med_cpu['ours'] / peak_cpu:.0%} | {same} |")
            notes.append(f"batch {batch} {what}: shardzoo " + ", ".join(f"{x:.2f}" for x in times["ours"])
                         + "; transformers " + ", ".join(f"{x:.2f}" for x in times["theirs"])
                         + f" (shardzoo's first call, compile included: {compile_s:.1f})")
            print(rows[-1], flush=True)
    a = config.arch
    lines = [
        "## Decoding: the Program's sampling loop against transformers' generate (CPU, one device)", "",
        f"Llama: hidden {a.hidden_size}, intermediate {a.intermediate_size}, {a.num_hidden_layers} layers, "
        f"{a.num_attention_heads} heads / {a.kv_heads} kv heads, vocab {a.vocab_size}, untied, "
        f"{config.num_params() / 1e6:.1f}M params, float32; built by transformers, saved, and loaded by "
        f"shardzoo (`train.hf_io.load_hf`), so both run the same weights. A {prompt_len}-token prompt "
        f"(every row full length), {new} new tokens per row, no early stop. shardzoo: "
        "`Program.generate` (prefill and the sampling loop in one compiled program, KV cache "
        "sharded by the rules, here dp on one device); transformers: `LlamaForCausalLM.generate` "
        f"(torch {torch.__version__}, the better of 1 and 2 threads each round, transformers "
        f"{transformers.__version__}, its dynamic KV cache). {rounds} interleaved rounds (shardzoo, "
        "transformers, ...) after a warm-up each; medians of the whole call (prompt in, tokens out). "
        f"Load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on "
        f"{os.cpu_count()} cores of an **{cpu_model()}** (a shared machine: the ratios are the figure, "
        "absolute times are noisy); glibc's malloc "
        f"{'keeping freed memory (host_memory), as the CLI sets it' if KEPT else 'as the environment left it'}.", "",
        "| batch | decoding | shardzoo (s) | tokens/s | transformers (s) | tokens/s | speed-up | "
        "shardzoo CPU s | transformers CPU s | speed-up in CPU time | model FLOP/s | of matmul peak | "
        "of matmul peak, CPU time | greedy tokens equal |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
        f"- Matmul peak (jnp.dot 2048x2048 float32, this run): {peak / 1e9:.1f} GFLOP/s of wall time, "
        f"{peak_cpu / 1e9:.1f} GFLOP per CPU second (all threads); 'of matmul peak' divides shardzoo's "
        "model FLOP/s by the first, 'CPU time' its FLOPs per CPU second by the second (what the "
        "load of other processes distorts least). Model FLOPs "
        f"per generated token: {decode_flops(a, prompt_len + (new - 1) / 2) / 1e6:.1f}M (2 x "
        f"{(decode_flops(a, 0) / 2) / 1e6:.1f}M matmul params, the output head included, + q.k and "
        f"probs.v over the {prompt_len + (new - 1) / 2:.0f} keys a new token attends on average); "
        "the prefill's FLOPs are not counted.",
        "- Greedy tokens equal: the fraction of new tokens equal to transformers' (the same model "
        "in float32; a near-tie can flip one token and the rest of that row after it).",
        "- Times (s), by round: " + "; ".join(notes) + ".", "",
    ]
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
