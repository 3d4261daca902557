"""The decoding cache's layout on a TPU: one layer's keys and values carried through a loop of
one-token steps (write the new position, then both attention products), plain
[batch, kv_heads, length, 64] against packed [batch, kv_heads / 2, length, 128] (two kv heads
side by side in a row, ``models/attention_kernels.py`` ``kv_pack``), llama3.2-1b's shapes at
batch 32. Prints the layout XLA chose for each cache and the microseconds per step against the
cache's read at 819 GB/s.

    python bench/tpu_kv_layout.py        # on the chip (bench/tpu_all.sh install first)
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp

B, KV, G, M, D, STEPS = 32, 8, 4, 384, 64, 256
P = 128 // D


def plain(cache_k, cache_v, q):
    def body(i, c):
        k, v = c
        new = jnp.full((B, KV, 1, D), i, jnp.bfloat16)
        k = jax.lax.dynamic_update_slice(k, new, (0, 0, i, 0))
        v = jax.lax.dynamic_update_slice(v, new, (0, 0, i, 0))
        p = jax.nn.softmax(jnp.einsum("bkgd,bkmd->bkgm", q, k, preferred_element_type=jnp.float32), -1)
        ctx = jnp.einsum("bkgm,bkmd->bkgd", p.astype(jnp.bfloat16), v)
        return k, v + 0 * ctx.sum().astype(v.dtype)
    return jax.lax.fori_loop(0, STEPS, body, (cache_k, cache_v))


def packed(cache_k, cache_v, q):
    eye = jnp.eye(P, dtype=q.dtype)
    qbd = jnp.einsum("bjhgd,hx->bjhgxd", q.reshape(B, KV // P, P, G, D), eye).reshape(B, KV // P, P * G, P * D)

    def body(i, c):
        k, v = c
        new = jnp.full((B, KV // P, 1, P * D), i, jnp.bfloat16)
        k = jax.lax.dynamic_update_slice(k, new, (0, 0, i, 0))
        v = jax.lax.dynamic_update_slice(v, new, (0, 0, i, 0))
        p = jax.nn.softmax(jnp.einsum("bjrx,bjmx->bjrm", qbd, k, preferred_element_type=jnp.float32), -1)
        ctx = jnp.einsum("bjrm,bjmx->bjrx", p.astype(jnp.bfloat16), v)
        return k, v + 0 * ctx.sum().astype(v.dtype)
    return jax.lax.fori_loop(0, STEPS, body, (cache_k, cache_v))


def main() -> None:
    q = jnp.ones((B, KV, G, D), jnp.bfloat16)
    for name, f, shape in (("plain", plain, (B, KV, M, D)), ("packed", packed, (B, KV // P, M, P * D))):
        zeros = jnp.zeros(shape, jnp.bfloat16)
        compiled = jax.jit(f, donate_argnums=(0, 1)).lower(zeros, zeros, q).compile()
        layout = [re.findall(r"bf16\[[\d,]+\]\{[^}]*\}", line)[:1] for line in compiled.as_text().splitlines()
                  if " while(" in line][:1]
        times = []
        for _ in range(4):
            k, v = jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)
            t = time.perf_counter()
            jax.block_until_ready(compiled(k, v, q))
            times.append(time.perf_counter() - t)
        bound = 2 * B * KV * M * D * 2 / 819e9
        print(f"{name}: cache layout {layout}, {min(times) / STEPS * 1e6:.1f} us/step "
              f"(the cache's read at 819 GB/s: {bound * 1e6:.1f} us)")


if __name__ == "__main__":
    main()
