"""Row gathers and their gradients on the chip, the MoE sorted dispatch's data movement: x [tokens,
embed] bf16 -> x[idx] [tokens * k, embed] (each token's k assignments, sorted by expert), the ways
it can be written, and the gradient (scatter-add, or a gather by the inverse permutation and a sum
over k). One line each: ms per call, median of 20 after 3 warm-up calls.

    python bench/tpu_gather.py --tokens 8192 --k 8 --embed 2048
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def timed(fn, *args, reps=20):
    out = fn(*args)
    jax.block_until_ready(out)
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times)), out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--embed", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=32)
    args = parser.parse_args(argv)
    t, k, d = args.tokens, args.k, args.embed
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.bfloat16)
    experts = rng.integers(0, args.experts, size=t * k)
    order = jnp.asarray(np.argsort(experts, kind="stable"), jnp.int32)
    inverse = jnp.argsort(order).astype(jnp.int32)
    src = order // k
    g = jnp.asarray(rng.normal(size=(t * k, d)), jnp.bfloat16)
    gbytes = t * k * d * 2 / 1e9

    def as_u32(a):  # adjacent bf16 features packed in one 32-bit word: rows independent in memory
        return jax.lax.bitcast_convert_type(a.reshape(a.shape[0], -1, 2), jnp.uint32)

    def from_u32(a):
        return jax.lax.bitcast_convert_type(a, jnp.bfloat16).reshape(a.shape[0], -1)

    variants = {
        "gather bf16 x[idx]": (lambda x, i: x[i], (x, src)),
        "gather bf16 take(mode=clip)": (lambda x, i: jnp.take(x, i, axis=0, mode="clip"), (x, src)),
        "gather as uint32 pairs": (lambda x, i: from_u32(as_u32(x)[i]), (x, src)),
        "gather as float32": (lambda x, i: x.astype(jnp.float32)[i].astype(jnp.bfloat16), (x, src)),
        "permute bf16 g[inverse]": (lambda g, i: g[i], (g, inverse)),
        "permute as uint32 pairs": (lambda g, i: from_u32(as_u32(g)[i]), (g, inverse)),
        "scatter-add bf16 (x[idx]'s gradient)": (
            lambda g, i: jnp.zeros((t, d), g.dtype).at[i].add(g), (g, src)),
        "gather by inverse + sum over k": (
            lambda g, i: g[i].reshape(t, k, d).astype(jnp.float32).sum(1).astype(g.dtype), (g, inverse)),
        "uint32 gather by inverse + sum over k": (
            lambda g, i: from_u32(as_u32(g)[i]).reshape(t, k, d).astype(jnp.float32).sum(1).astype(g.dtype),
            (g, inverse)),
        "scatter bf16 (a permutation's gradient)": (
            lambda g, i: jnp.zeros_like(g).at[i].set(g, unique_indices=True), (g, order)),
    }
    ref = {}
    print(f"{jax.devices()[0].device_kind}: tokens {t}, k {k}, embed {d}, {gbytes:.3f} GB per [tokens*k, embed] array")
    for name, (fn, fargs) in variants.items():
        ms, out = timed(jax.jit(fn), *fargs)
        key = out.shape
        same = "" if key not in ref else f", max diff to the first of its shape {float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref[key].astype(jnp.float32)))):.3g}"
        ref.setdefault(key, out)
        print(f"| {name} | {ms:.2f} ms | {gbytes / ms * 1e3:.0f} GB/s of one array{same} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
