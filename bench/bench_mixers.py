"""Token mixers against sequence length: forward+backward tokens/s of one layer's mixer on CPU.

One attention layer (GQA, qwen3-next's attention: output gate, qk-norm, partial rotary) against
one Gated DeltaNet layer (models/linear_attention.py, chunks of 64) of the same width, at 512,
2048 and 8192 tokens: the mixer alone (no MLP, no norm), one row, float32, the gradient of a
probe of its output with respect to its input and parameters, one jitted call timed (best of
``--rounds`` after a warm-up). Widths: hidden 256; attention 4 heads of 64 (2 kv heads); the
Gated DeltaNet 2 key heads and 4 value heads of 64 (Qwen3-Next's ratios at an eighth of its width).
Goal: attention's time grows as the length squared, the Gated DeltaNet's linearly.

    python bench/bench_mixers.py [--lengths 512,2048,8192] [--out bench/results/mixers.md]
    python -m bench --only mixers
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from report import write_section  # noqa: E402  (bench/report.py)

from shardzoo.models import get_config  # noqa: E402
from shardzoo.models.attention import Attention  # noqa: E402
from shardzoo.models.linear_attention import GatedDeltaNet  # noqa: E402

WIDTH = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
             linear_value_head_dim=64, max_position_embeddings=8192, linear_attention_chunk=64)


def mixers():
    """name -> a function (length) -> (module, apply arguments)."""
    config = get_config("qwen3-next-tiny", **WIDTH)
    attention_spec = next(s for s in config.layer_specs() if s.mixer == "attention")

    def attention(x, positions):
        return Attention(config, attention_spec), (x, positions)

    def gated_deltanet(x, positions):
        return GatedDeltaNet(config), (x,)

    return {"attention": attention, "gated_deltanet": gated_deltanet}


def measure(build, length: int, rounds: int) -> float:
    """Seconds of one forward+backward of the mixer on one row of ``length`` tokens."""
    x = jax.random.normal(jax.random.key(0), (1, length, WIDTH["hidden_size"]), jnp.float32)
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    module, args = build(x, positions)
    params = jax.jit(module.init)(jax.random.key(1), *args)["params"]
    probe = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)

    def loss(params, x):
        return jnp.sum(module.apply({"params": params}, x, *args[1:]) * probe)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    jax.block_until_ready(step(params, x))  # compile and warm up
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(step(params, x))
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="markdown file to write")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    table = {}
    for name, build in mixers().items():
        for n in lengths:
            table.setdefault(name, []).append(measure(build, n, args.rounds))
            print(f"{name} {n}: {table[name][-1]:.3f} s", file=sys.stderr, flush=True)
    lines = ["## Token mixers against length (forward+backward, one layer's mixer, CPU)", "",
             "| mixer | " + " | ".join(f"{n} tokens/s" for n in lengths) + " | time x (first to last length) |",
             "|---|" + "---|" * (len(lengths) + 1)]
    for name, seconds in table.items():
        rates = " | ".join(f"{n / s:,.0f}" for n, s in zip(lengths, seconds, strict=True))
        lines.append(f"| {name} | {rates} | {seconds[-1] / seconds[0]:.1f} |")
    lines += ["", f"Length x{lengths[-1] // lengths[0]}: a cost linear in length grows the time as much, a "
              "quadratic one as its square."]
    write_section("\n".join(lines) + "\n", args.out, "mixers.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
