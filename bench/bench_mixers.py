"""One token mixer's forward+backward tokens/s against the sequence length: attention beside
the layers that replace it in hybrid models.

Each mixer is the module a shardzoo block runs in place of attention (``models/attention.py``,
``models/conv_mixer.py``, ...), at one width (hidden 512), on one CPU device, float32, batch 1,
at sequence 512, 2048 and 8192. A step is a jitted ``value_and_grad`` of <mixer(x), a fixed
projection> with respect to the parameters and the input: the cost of the layer in a train
step, without the MLP (the same for every kind). The mixers run in interleaved rounds
(A B C ... A B C ...) at each length; the report gives medians, tokens/s, and each mixer's time
relative to attention's at the same length (per round, then the median). Attention runs
jax's XLA path (the scores materialised: what the CPU has); the recurrent layers run their
chunked training forms.

    python bench/bench_mixers.py [--lengths 512,2048,8192] [--rounds 3] [--out bench/results/mixers.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from shardzoo.models.arch import ATTENTION, CONV, LayerSpec  # noqa: E402
from shardzoo.models.attention import Attention  # noqa: E402
from shardzoo.models.conv_mixer import ShortConv  # noqa: E402
from shardzoo.models.linear_attention import GatedDeltaNet  # noqa: E402
from shardzoo.models.ssm import Mamba2Mixer  # noqa: E402
from shardzoo.models.transformer import TransformerConfig  # noqa: E402

HIDDEN, HEADS, HEAD_DIM = 512, 8, 64
BASE = dict(vocab_size=256, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=1,
            num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
            max_position_embeddings=16384, attention_impl="xla", scan_layers=False)


def attention(length):
    config = TransformerConfig.from_fields(**BASE)
    module = Attention(config, LayerSpec(mixer=ATTENTION))
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    return "attention (8 heads x 64, causal, XLA)", module, lambda m, x: m(x, positions, None, False)


def short_conv(length):
    config = TransformerConfig.from_fields(**BASE, layer_types=(CONV,), conv_kernel=3)
    module = ShortConv(config)
    return "gated short convolution (LFM2, 3 taps)", module, lambda m, x: m(x, None, False)


def mamba2(length):
    # Mamba2's shape at this width: expand 2 (16 heads of 64), one group, state 128, chunks of 256
    config = TransformerConfig.from_fields(**BASE, layer_types=("mamba",), mlp_layer_types=("none",),
                                           mamba_num_heads=2 * HIDDEN // 64, mamba_head_dim=64, mamba_n_groups=1,
                                           ssm_state_size=128, mamba_chunk_size=256)
    return "Mamba2 (16 heads x 64, state 128, chunks of 256)", Mamba2Mixer(config), lambda m, x: m(x, None, False)


def gated_deltanet(length):
    # Qwen3-Next's ratios at this width: 4 key heads and 8 value heads of 64 (values as wide as the
    # hidden size), a convolution of 4 taps, chunks of 64
    config = TransformerConfig.from_fields(**BASE, layer_types=("linear_attention",), linear_num_key_heads=4,
                                           linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                                           linear_conv_kernel_dim=4, linear_attention_chunk=64)
    return ("Gated DeltaNet (4 key / 8 value heads x 64, chunks of 64)", GatedDeltaNet(config),
            lambda m, x: m(x, None, False))


MIXERS = {"attention": attention, "conv": short_conv, "gated_deltanet": gated_deltanet, "mamba2": mamba2}


def make_step(module, call):
    def loss(params, x, proj):
        return jnp.sum(call(module.bind({"params": params}), x) * proj)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def variants_at(length: int, names, rng):
    x = jnp.asarray(rng.normal(size=(1, length, HIDDEN)).astype(np.float32))
    proj = jnp.asarray(rng.normal(size=(1, length, HIDDEN)).astype(np.float32) / HIDDEN)
    out = {}
    for name in names:
        label, module, call = MIXERS[name](length)
        params = jax.jit(lambda x, module=module, call=call: module.init(
            jax.random.key(0), x, method=lambda m, x: call(m, x)))(x)["params"]
        params = jax.tree.map(lambda p: getattr(p, "value", p), params,
                              is_leaf=lambda p: hasattr(p, "value"))
        n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
        out[name] = (label, n_params, make_step(module, call), (params, x, proj))
    return out


def time_rounds(variants, rounds: int) -> dict[str, list[float]]:
    samples = {name: [] for name in variants}
    for _, _, step, args in variants.values():  # compile and warm up
        jax.block_until_ready(step(*args))
    for _ in range(rounds):
        for name, (_, _, step, args) in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            samples[name].append(time.perf_counter() - start)
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--mixers", default=",".join(MIXERS), help=f"comma-separated, of: {', '.join(MIXERS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "mixers.md"))
    args = parser.parse_args(argv)
    given = list(argv if argv is not None else sys.argv[1:])
    if "--out" in given:
        del given[given.index("--out"):given.index("--out") + 2]
    names = args.mixers.split(",")
    lengths = [int(s) for s in args.lengths.split(",")]
    rng = np.random.default_rng(0)
    load = os.getloadavg()[0]
    rows, labels = [], {}
    for length in lengths:
        print(f"length {length}: timing {len(names)} mixers, {args.rounds} rounds ...", file=sys.stderr)
        variants = variants_at(length, names, rng)
        samples = time_rounds(variants, args.rounds)
        base = samples.get(names[0])
        for name in names:
            label, n_params, _, _ = variants[name]
            labels[name] = (label, n_params)
            med = statistics.median(samples[name])
            ratio = statistics.median(a / b for a, b in zip(samples[name], base, strict=True))
            rows.append((length, name, med, length / med, ratio))
    first = names[0]
    lines = [
        "## Token mixers: forward+backward tokens/s against the sequence length (CPU, one device)",
        "",
        f"`{shlex.join(['python', 'bench/bench_mixers.py', *given])}` on {platform.machine()} with "
        f"{os.cpu_count()} cores, jax {jax.__version__}, float32, batch 1, hidden {HIDDEN}. One mixer "
        "(no MLP, no norm): a jitted value_and_grad of the layer with respect to its parameters and "
        f"input. {args.rounds} interleaved rounds per length after a warm-up; medians; 'vs {first}' is "
        f"the median over rounds of the mixer's time over {first}'s in the same round. Load average "
        f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (a shared machine: ratios are the "
        "figure).",
        "",
        "| mixer | parameters |",
        "|---|---:|",
        *[f"| {label} | {n:,} |" for label, n in labels.values()],
        "",
        f"| length | mixer | ms / step | tokens/s | time vs {first} |",
        "|---:|---|---:|---:|---:|",
        *[f"| {length} | {labels[name][0]} | {med * 1e3:,.1f} | {tps:,.0f} | {ratio:.2f}x |"
          for length, name, med, tps, ratio in rows],
    ]
    growth = []
    for name in names:
        times = {length: med for length, n, med, _, _ in rows if n == name}
        lo, hi = min(lengths), max(lengths)
        growth.append(f"{labels[name][0]}: {times[hi] / times[lo]:.1f}x")
    lines += ["", f"- Time per step from {min(lengths)} to {max(lengths)} tokens ({max(lengths) // min(lengths)}x "
              f"the tokens): " + "; ".join(growth) + "."]
    report = "\n".join(lines) + "\n"
    print(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
