"""MoE layer forward+backward throughput per dispatch strategy, against a dense MLP.

At 8 experts top-2 and 128 experts top-8, on one CPU device: a dense gated MLP of the same
*active* parameters (width k * intermediate) and ``MoeMLP`` with indexed and capacity dispatch
(factor 1.25; at 8 experts also "ample", i.e. no drops, and dropless ragged_dot). Then, on a
mesh of fake CPU devices sharing the same cores, indexed and capacity dispatch under ``ep``
(XLA's all-to-all) against shard_map dispatch: dispatch mechanics on the same hardware, not
scaling. On a TPU (``JAX_PLATFORMS=tpu``: one chip, no ep rows), also dropless ragged_dot at every
size and ``gmm`` (megablox's Pallas grouped matmul).

Variants run in interleaved rounds (A B C ... A B C ...); each round times ``--iters`` calls of
a jitted value_and_grad; the report gives medians over rounds, tokens/s and ratios to dense
(of the medians, and the median of the per-round ratios).

    python bench/bench_moe.py [--settings '8x top-2,128x top-8'] [--rounds 5] [--iters 2]
    JAX_PLATFORMS=tpu python bench/bench_moe.py --settings qwen3-30b-a3b --embed 2048 --batch 4 \
        --length 2048 --dtype bfloat16 --out bench/results/tpu_moe.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import shlex
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
from shardzoo.sharding.partition import Placement, activate  # noqa: E402

DENSE = "dense MLP (width k*intermediate)"


def dense_mlp(params, x, dtype="float32"):
    """Gated (SwiGLU) MLP: the dense model with the MoE layer's active parameters (in ``dtype``)."""
    x, params = x.astype(dtype), jax.tree.map(lambda w: w.astype(dtype), params)
    h = jax.nn.silu(x @ params["gate"]) * (x @ params["up"])
    return h @ params["down"]


def make_step(fn):
    """A jitted value_and_grad of <fn(params, x), a fixed projection> (+ the MoE aux losses)."""

    def loss(params, x, proj):
        y, aux = fn(params, x)
        return jnp.sum(y * proj) + aux

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def moe_fn(cfg, placement=None):
    def fn(params, x):
        y, state = MoeMLP(cfg, placement).apply({"params": params}, x, mutable=["losses", "metrics"])
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


SETTINGS = {  # name: (experts, top-k, expert intermediate size); dense width k * intermediate
    "8x top-2": (8, 2, 512),
    "128x top-8": (128, 8, 128),
    "qwen3-30b-a3b": (128, 8, 768),  # its MoE layer (with --embed 2048): for a TPU
}


def setting_variants(e, k, d, m, b, length, r, mesh, dtype="float32"):
    """{name: (step, args, context)} for one expert count: dense, every dispatch, ep variants.

    ``dropless`` (ragged_dot) and the no-drop ("ample") capacities run at 8 experts only: on
    CPU ragged_dot computes every group densely, and ample buffers hold experts/k x the
    tokens, so at 128 experts one step takes minutes. On a TPU (``mesh`` None: one chip)
    dropless and ``gmm`` run at every size, the ep rows not at all.
    """
    tpu = mesh is None
    normal = lambda *shape: jnp.asarray(r.normal(size=shape).astype(np.float32) / np.sqrt(shape[-2]))
    x, proj = normal(b, length, d), normal(b, length, d)
    moe_params = {"router": {"kernel": normal(d, e)}, "wi_gate": normal(e, d, m),
                  "wi_up": normal(e, d, m), "wo": normal(e, m, d)}
    dense_params = {"gate": normal(d, k * m), "up": normal(d, k * m), "down": normal(k * m, d)}
    base = MoeConfig(num_experts=e, num_experts_per_tok=k, intermediate_size=m, dtype=dtype)
    cfg = lambda **kw: dataclasses.replace(base, **kw)
    ample = e / k  # capacity = length: no token can be dropped
    single = {DENSE: (make_step(lambda p, x: (dense_mlp(p, x, dtype), 0.0)), dense_params)}
    for dispatch in ("indexed", "capacity"):
        single[f"{dispatch}, factor 1.25"] = (make_step(moe_fn(cfg(dispatch=dispatch))), moe_params)
    if e <= 8:
        for dispatch in ("indexed", "capacity"):
            single[f"{dispatch}, factor {ample:g} (ample)"] = (
                make_step(moe_fn(cfg(dispatch=dispatch, capacity_factor=ample))), moe_params)
    if e <= 8 or tpu:
        single["dropless (ragged_dot)"] = (make_step(moe_fn(cfg(dispatch="dropless"))), moe_params)
    if tpu:
        single["gmm (megablox Pallas)"] = (make_step(moe_fn(cfg(dispatch="gmm"))), moe_params)
    none = contextlib.nullcontext
    variants = {name: (step, (p, x, proj), none) for name, (step, p) in single.items()}
    if tpu:
        return variants
    placement = Placement(mesh, get_rules("ep"))
    for dispatch in ("indexed", "capacity", "shard_map"):
        variants[f"{dispatch}, ep on expert={MESH_DEVICES} (fake devices)"] = (
            make_step(moe_fn(cfg(dispatch=dispatch), placement)), (moe_params, x, proj), lambda: activate(mesh))
    return variants


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated, of: {', '.join(SETTINGS)}")
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "moe.md"))
    args = parser.parse_args(argv)

    given = list(argv if argv is not None else sys.argv[1:])
    if "--out" in given:  # the command as one would type it, without where the section goes
        del given[given.index("--out"):given.index("--out") + 2]
    d, b, length = args.embed, args.batch, args.length
    tokens = b * length
    tpu = jax.default_backend() == "tpu"
    mesh = None if tpu else make_mesh(f"expert={MESH_DEVICES}")
    where = (f"one {jax.devices()[0].device_kind} chip" if tpu
             else f"{platform.machine()} with {os.cpu_count()} cores")
    load = os.getloadavg()[0]
    lines = [
        f"## MoE layer: forward+backward tokens/s per dispatch ({'TPU' if tpu else 'CPU'})",
        "",
        f"`{shlex.join(['python', 'bench/bench_moe.py', *given])}` "
        f"on {where}, jax {jax.__version__}, {args.dtype}. "
        f"Embed {d}, batch {b} x length {length} = {tokens} tokens (a capacity group is one row "
        f"of {length}); against a dense SwiGLU MLP of width k x the expert intermediate size (the "
        f"same active parameters). Each step is a jitted value_and_grad (forward+backward) of "
        f"the layer. {args.rounds} interleaved rounds (A B C ... A B C ...) of {args.iters} "
        f"calls; medians, and the median of each round's ratio to that round's dense time "
        f"(neighbours in time share the load). The machine is shared with other jobs (load average {load:.1f} at "
        f"the start): absolute times are noisy, the interleaved ratios less so. "
        + ("One chip: no ep rows; `gmm` is megablox's Pallas grouped matmul (dropless, as ragged_dot). " if tpu else
           f"The ep rows run on {MESH_DEVICES} fake CPU devices sharing the same cores (rules ep): dispatch "
           "mechanics, not scaling. ")
        + "The default dispatch is `indexed`.",
    ]
    for name in args.settings.split(","):
        e, k, m = SETTINGS[name]
        variants = setting_variants(e, k, d, m, b, length, np.random.default_rng(0), mesh, args.dtype)
        print(f"{name}: timing {len(variants)} variants, {args.rounds} rounds x {args.iters} calls ...",
              file=sys.stderr)
        samples = time_rounds(variants, args.rounds, args.iters)
        medians = {v: statistics.median(s) for v, s in samples.items()}
        dense = medians[DENSE]
        capacity = MoeConfig(num_experts=e, num_experts_per_tok=k, intermediate_size=m).capacity(length)
        lines += [
            "",
            f"### {e} experts, top-{k}, expert intermediate {m} (dense width {k * m}; "
            f"capacity at factor 1.25: {capacity} slots per expert and row)",
            "",
            "| variant | ms / step (median) | min-max over rounds | tokens/s | vs dense | "
            "vs dense, per round (median, min-max) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for v, med in medians.items():
            lo, hi = min(samples[v]) * 1e3, max(samples[v]) * 1e3
            ratios = [a / b for a, b in zip(samples[DENSE], samples[v], strict=True)]
            lines.append(f"| {v} | {med * 1e3:.1f} | {lo:.1f}-{hi:.1f} | {tokens / med:,.0f} | "
                         f"{dense / med:.2f}x | {statistics.median(ratios):.2f}x "
                         f"({min(ratios):.2f}-{max(ratios):.2f}) |")
        if e > 8 and not tpu:
            lines += ["", "Not timed at this size: dropless (ragged_dot computes every one of "
                      f"the {e} groups densely on CPU; one step did not finish in 5 minutes) and "
                      "the ample (no-drop) capacities."]
    report = "\n".join(lines) + "\n"
    print(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
