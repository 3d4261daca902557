"""Forward+backward tokens/s of one Mamba2 layer against one attention layer of the same width,
as the sequence grows (the reason state-space layers exist), on this machine's CPU.

Each model: embeddings (vocab 256), one layer without MLP (a mamba mixer of mamba2-130m's shape:
hidden 768, 24 heads of 64, one group, state 128, chunks of 256; or attention with 12 heads of
64), the final norm and head; batch 1, float32; the median of 3 jitted steps after compiling.

    python bench/bench_ssm.py [--lengths 512 2048 8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from flax import linen as nn

from shardzoo.models import get_model

COMMON = dict(vocab_size=256, hidden_size=768, num_attention_heads=12, num_hidden_layers=1, intermediate_size=3072,
              max_position_embeddings=8192, bos_token_id=None, eos_token_id=None)
MAMBA = dict(layer_types=("mamba",), mlp_layer_types=("none",), mamba_num_heads=24, mamba_head_dim=64,
             mamba_n_groups=1, ssm_state_size=128, mamba_chunk_size=256)
ATTENTION = dict(layer_types=("full_attention",), mlp_layer_types=("none",))


def tokens_per_second(fields: dict, length: int, steps: int = 3) -> float:
    module, _ = get_model("mamba2-tiny", **COMMON, **fields)
    tokens = jnp.zeros((1, length), jnp.int32)
    params = nn.unbox(module.init(jax.random.key(0), tokens))["params"]
    step = jax.jit(jax.grad(lambda p, t: jnp.mean(module.apply({"params": p}, t))))
    jax.block_until_ready(step(params, tokens))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(step(params, tokens))
        times.append(time.perf_counter() - start)
    return length / statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    args = parser.parse_args(argv)
    print("| sequence | Mamba2 layer tokens/s | attention layer tokens/s | Mamba2 / attention |")
    print("|---:|---:|---:|---:|")
    for length in args.lengths:
        m, a = tokens_per_second(MAMBA, length), tokens_per_second(ATTENTION, length)
        print(f"| {length} | {m:,.0f} | {a:,.0f} | {m / a:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
