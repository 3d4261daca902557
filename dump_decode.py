"""Layout of a decoding cache carried through a loop, DUS one position per step + attention."""
import re, time, jax, jax.numpy as jnp, numpy as np
B, KV, G, M, D, STEPS = 32, 8, 4, 384, 64, 256

def run_plain(cache_k, cache_v, q):
    def body(i, c):
        k, v = c
        new = jnp.full((B, KV, 1, D), i, jnp.bfloat16)
        k = jax.lax.dynamic_update_slice(k, new, (0, 0, i, 0)); v = jax.lax.dynamic_update_slice(v, new, (0, 0, i, 0))
        s = jnp.einsum("bkgd,bkmd->bkgm", q, k, preferred_element_type=jnp.float32)
        p = jax.nn.softmax(s, -1).astype(jnp.bfloat16)
        ctx = jnp.einsum("bkgm,bkmd->bkgd", p, v)
        return k, v + 0 * ctx.sum().astype(v.dtype)
    return jax.lax.fori_loop(0, STEPS, body, (cache_k, cache_v))

P = 128 // D
def run_packed(cache_k, cache_v, q):
    # cache [B, KV/P, M, P*D]; q block-diagonal [B, KV/P, P*G, P*D]
    eye = jnp.eye(P, dtype=q.dtype)
    qp = q.reshape(B, KV // P, P, G, D)
    qbd = jnp.einsum("bjhgd,hx->bjhgxd", qp, eye).reshape(B, KV // P, P * G, P * D)
    def body(i, c):
        k, v = c
        new = jnp.full((B, KV // P, 1, P * D), i, jnp.bfloat16)
        k = jax.lax.dynamic_update_slice(k, new, (0, 0, i, 0)); v = jax.lax.dynamic_update_slice(v, new, (0, 0, i, 0))
        s = jnp.einsum("bjrx,bjmx->bjrm", qbd, k, preferred_element_type=jnp.float32)
        p = jax.nn.softmax(s, -1).astype(jnp.bfloat16)
        ctx = jnp.einsum("bjrm,bjmx->bjrx", p, v)
        return k, v + 0 * ctx.sum().astype(v.dtype)
    return jax.lax.fori_loop(0, STEPS, body, (cache_k, cache_v))

for name, f, shape in (("plain", run_plain, (B, KV, M, D)), ("packed", run_packed, (B, KV // P, M, P * D))):
    k = jnp.zeros(shape, jnp.bfloat16); v = jnp.zeros(shape, jnp.bfloat16)
    q = jnp.ones((B, KV, G, D), jnp.bfloat16)
    c = jax.jit(f, donate_argnums=(0, 1)).lower(k, v, q).compile()
    text = c.as_text()
    dus = [l.strip()[:140] for l in text.splitlines() if "dynamic-update-slice(" in l and "bf16[" in l.split("=")[1][:30]]
    print(name, dus[:2])
    print(name, [re.findall(r"bf16\[[\d,]+\]\{[^}]*\}", l)[:2] for l in text.splitlines() if " while(" in l][:1])
    ts = []
    for _ in range(4):
        k = jnp.zeros(shape, jnp.bfloat16); v = jnp.zeros(shape, jnp.bfloat16)
        t = time.perf_counter(); out = c(k, v, q); jax.block_until_ready(out); ts.append(time.perf_counter() - t)
    cache_bytes = 2 * B * KV * M * D * 2
    print(name, "us/step", min(ts) / STEPS * 1e6, "bound us/step", cache_bytes / 819e9 * 1e6)
