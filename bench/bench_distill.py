"""What a distillation step costs against an SFT step of the same student, on one CPU device.

The student is bench_transformer.py's Llama (hidden 512, 4 layers, vocab 8192, float32); the
teacher a Qwen2 twice as deep with the same vocabulary. The SFT row is the language-model step
``shardzoo train`` runs; the distillation rows are ``--task distill``'s: the teacher's compiled
forward (``Program.teacher.compiled_step``, its logits a float32 batch entry) and then the
student's step on them, full vocabulary (forward KL, ``beta`` 0) and top-k 64. Interleaved rounds
(every row once per round) after a warm-up, medians and ratios to SFT.

    python bench/bench_distill.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen as nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_transformer import BATCH, CONFIG, LENGTH  # noqa: E402
from program_step import cpu_model, one_device_program, packed_batch, stepper  # noqa: E402
from report import write_section  # noqa: E402

from shardzoo.models.transformer import TransformerConfig  # noqa: E402
from shardzoo.sharding import get_rules, make_mesh  # noqa: E402
from shardzoo.train.config import TrainConfig  # noqa: E402
from shardzoo.train.optim import make_optimizer  # noqa: E402
from shardzoo.train.program import Program  # noqa: E402
from shardzoo.train.tasks.distill import distill_task  # noqa: E402

TEACHER = TransformerConfig.from_fields(
    vocab_size=CONFIG.vocab_size, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, attention_bias=True,
    tie_word_embeddings=False)


def distill_runner(top_k: int):
    """One distillation step (teacher forward, then the student's step), run to completion."""
    mesh, rules = make_mesh("data=1", devices=jax.devices()[:1]), get_rules("dp")
    program = Program(CONFIG, rules, mesh, optimizer=functools.partial(make_optimizer, TrainConfig(lr=1e-4)),
                      task=distill_task(top_k=top_k), batch_size=BATCH, seq_len=LENGTH, teacher=TEACHER)
    teacher = program.teacher.compiled_step()
    teacher_params = jax.jit(lambda k: nn.meta.unbox(program.teacher.module.init(
        k, np.zeros((1, 8), np.int32))["params"]))(jax.random.key(1))
    batch = program.place(packed_batch(CONFIG.vocab_size, BATCH, LENGTH))
    step, box = program.compiled_train_step(), {"state": program.init(jax.random.key(0))}

    def run():
        placed = dict(batch, **teacher(teacher_params, batch))
        box["state"], metrics = step(box["state"], placed, jax.random.PRNGKey(0))
        jax.block_until_ready(metrics["loss"])

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sft = one_device_program(CONFIG, BATCH, LENGTH, lr=1e-4)
    runs = {"SFT (--task lm)": stepper(sft, sft.init(jax.random.key(0)), packed_batch(CONFIG.vocab_size, BATCH, LENGTH)),
            "distill, full vocabulary (forward KL)": distill_runner(0),
            "distill, teacher's top-64": distill_runner(64)}
    for run in runs.values():
        run()
    times = {n: [] for n in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    med = {n: statistics.median(v) for n, v in times.items()}
    base = med["SFT (--task lm)"]
    lines = [f"`python bench/bench_distill.py --rounds {args.rounds}`", "",
             f"CPU: {cpu_model()}, {os.cpu_count()} CPUs (load average at the end {os.getloadavg()[0]:.1f}); "
             f"student: Llama hidden {CONFIG.hidden_size}, {CONFIG.num_hidden_layers} layers, vocab "
             f"{CONFIG.vocab_size}; teacher: Qwen2-style, {TEACHER.arch.num_hidden_layers} layers, same width; "
             f"batch {BATCH} x {LENGTH}, float32, adamw; {args.rounds} interleaved rounds, medians.", "",
             "| step | s | vs SFT |", "|---|---:|---:|"]
    lines += [f"| {n} | {s:.3f} | {s / base:.2f}x |" for n, s in med.items()]
    write_section("\n".join(lines) + "\n", args.out, "distill.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
