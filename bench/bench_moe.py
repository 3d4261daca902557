"""MoE layer forward+backward throughput per dispatch strategy, against a dense MLP.

One CPU device: a dense gated MLP of the same *active* parameters (width k * intermediate)
and ``MoeMLP`` with capacity dispatch (factor 1.25 and "ample", i.e. no drops) and dropless
(ragged_dot) dispatch. Then, on a mesh of fake CPU devices sharing the same cores, capacity
dispatch under ``ep`` (XLA's all-to-all) against shard_map dispatch: dispatch mechanics on the
same hardware, not scaling.

Variants run in interleaved rounds (A B C ... A B C ...); each round times ``--iters`` calls of
a jitted value_and_grad; the report gives medians over rounds, tokens/s and ratios to dense.

    python bench/bench_moe.py [--rounds 5] [--iters 2] [--out bench/results/moe.md]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

MESH_DEVICES = 2
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={MESH_DEVICES}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from shardzoo.models.moe import MoeConfig, MoeMLP  # noqa: E402
from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.sharding.partition import activate  # noqa: E402


def dense_mlp(params, x):
    """Gated (SwiGLU) MLP: the dense model with the MoE layer's active parameters."""
    h = jax.nn.silu(x @ params["gate"]) * (x @ params["up"])
    return h @ params["down"]


def make_step(fn):
    """A jitted value_and_grad of <fn(params, x), a fixed projection> (+ the MoE aux losses)."""

    def loss(params, x, proj):
        y, aux = fn(params, x)
        return jnp.sum(y * proj) + aux

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def moe_fn(cfg):
    def fn(params, x):
        y, state = MoeMLP(cfg).apply({"params": params}, x, mutable=["losses", "metrics"])
        return y, sum(jnp.sum(leaf) for leaf in jax.tree.leaves(state["losses"]))

    return fn


def time_rounds(variants, rounds: int, iters: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, one median-able sample per round, interleaved."""
    samples = {name: [] for name in variants}
    for step, args, context in variants.values():  # compile and warm up
        with context():
            jax.block_until_ready(step(*args))
    for _ in range(rounds):
        for name, (step, args, context) in variants.items():
            with context():
                start = time.perf_counter()
                for _ in range(iters):
                    out = step(*args)
                jax.block_until_ready(out)
                samples[name].append((time.perf_counter() - start) / iters)
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--mlp", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "moe.md"))
    args = parser.parse_args(argv)

    e, k, d, m, b, length = args.experts, args.top_k, args.embed, args.mlp, args.batch, args.length
    tokens = b * length
    r = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(r.normal(size=shape).astype(np.float32) / np.sqrt(shape[-2]))
    x, proj = normal(b, length, d), normal(b, length, d)
    moe_params = {"router": {"kernel": normal(d, e)}, "wi_gate": normal(e, d, m),
                  "wi_up": normal(e, d, m), "wo": normal(e, m, d)}
    dense_params = {"gate": normal(d, k * m), "up": normal(d, k * m), "down": normal(k * m, d)}
    base = MoeConfig(num_experts=e, num_experts_per_tok=k, intermediate_size=m)
    ample = e / k  # capacity = length: no token can be dropped

    none = contextlib.nullcontext
    mesh = make_mesh(f"expert={MESH_DEVICES}")
    on_mesh = lambda: activate(mesh, get_rules("ep"))
    single = {
        "dense MLP (width k*mlp)": (make_step(lambda p, x: (dense_mlp(p, x), 0.0)), dense_params),
        "capacity, factor 1.25": (make_step(moe_fn(base)), moe_params),
        f"capacity, factor {ample:g} (ample)": (
            make_step(moe_fn(MoeConfig(**{**base.__dict__, "capacity_factor": ample}))), moe_params),
        "dropless (ragged_dot)": (
            make_step(moe_fn(MoeConfig(**{**base.__dict__, "dispatch": "dropless"}))), moe_params),
    }
    variants = {name: (step, (p, x, proj), none) for name, (step, p) in single.items()}
    for dispatch in ("capacity", "shard_map"):
        cfg = MoeConfig(**{**base.__dict__, "dispatch": dispatch})
        variants[f"{dispatch}, ep on expert={MESH_DEVICES} (fake devices)"] = (
            make_step(moe_fn(cfg)), (moe_params, x, proj), on_mesh)

    print(f"timing {len(variants)} variants, {args.rounds} rounds x {args.iters} calls ...", file=sys.stderr)
    samples = time_rounds(variants, args.rounds, args.iters)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    dense = medians["dense MLP (width k*mlp)"]

    lines = [
        "## MoE layer: forward+backward tokens/s per dispatch (CPU)",
        "",
        f"`python bench/bench_moe.py` on {platform.machine()} with {os.cpu_count()} cores, jax "
        f"{jax.__version__}, float32. {e} experts, top-{k}, embed {d}, mlp {m}, "
        f"batch {b} x length {length} = {tokens} tokens (a capacity group is one row of {length}); "
        f"dense MLP of width {k}x{m} = {k * m} (the same active parameters). "
        f"{args.rounds} interleaved rounds of {args.iters} calls; medians. The last two rows "
        f"run on {MESH_DEVICES} fake CPU devices sharing the same cores (rules ep).",
        "",
        "| variant | ms / step (median) | min-max over rounds | tokens/s | vs dense |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, med in medians.items():
        lo, hi = min(samples[name]) * 1e3, max(samples[name]) * 1e3
        lines.append(f"| {name} | {med * 1e3:.1f} | {lo:.1f}-{hi:.1f} | {tokens / med:,.0f} | "
                     f"{dense / med:.2f}x |")
    report = "\n".join(lines) + "\n"
    print(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
