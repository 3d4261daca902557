"""EasyDeL's own train step at bench_cpu.py's shapes, timed on CPU: one JSON line per run.

Runs under an EasyDeL virtual environment's python (it imports nothing from shardzoo): EasyDeL's
``LlamaForCausalLM`` (hidden 512, intermediate 1408, 4 layers, 8 heads / 4 kv heads, vocab 8192,
untied, float32, EasyDeL's default attention) driven by ``ed.Trainer``: the step timed is the
trainer's compiled ``sharded_training_step_function`` (``trainers/trainer/_fn.py``'s
``training_step``: causal-LM loss, value_and_grad, optax adamw with the trainer's clipping,
weight decay and cosine schedule), called exactly as ``Trainer._execute_train_step`` calls it,
on one batch of 8 x 256 tokens. Warm-up steps, then timed steps; wall seconds
(``time.perf_counter``) and process CPU seconds (``time.process_time``) per step.

    /tmp/edl_venv/bin/python bench/bench_easydel.py [--warmup 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# bench_transformer.py's CONFIG, BATCH, LENGTH, LR and shardzoo's TrainConfig optimizer defaults,
# restated (this script must not import shardzoo: it runs in EasyDeL's environment).
MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
             tie_word_embeddings=False, rms_norm_eps=1e-5)
BATCH, LENGTH, LR = 8, 256, 1e-4
WARMUP_STEPS, WEIGHT_DECAY, CLIP_NORM = 20, 0.1, 1.0
SCHEDULE_STEPS = 100  # the trainer clamps its step count to the dataset's batches: this many of them


RESULT_KEYS = ("wall_s", "cpu_s", "losses", "easydel", "jax")


def parse_result(stdout: str) -> dict:
    """The result of one run: the last line of ``stdout`` that is a JSON object with RESULT_KEYS
    (EasyDeL and XLA may print their own lines around it). ValueError if there is none."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(result, dict) and all(k in result for k in RESULT_KEYS):
            return result
    raise ValueError(f"bench_easydel.py printed no result line (a JSON object with {', '.join(RESULT_KEYS)})")


def run(python: str, warmup: int = 2, steps: int = 3) -> dict:
    """This script run once by ``python`` (an EasyDeL environment's interpreter) in a fresh process:
    its parsed result. RuntimeError with the end of its stderr if it fails."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("PYTHONPATH", None)  # EasyDeL's environment, not shardzoo's
    proc = subprocess.run([python, os.path.abspath(__file__), "--warmup", str(warmup), "--steps", str(steps)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{python} bench/bench_easydel.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    try:
        return parse_result(proc.stdout)
    except ValueError as e:
        raise RuntimeError(f"{e}; its stderr ends:\n{proc.stderr[-3000:]}") from None


def build(save_dir: str):
    """An ``ed.Trainer`` over EasyDeL's Llama and its one batch (dict of jax arrays)."""
    import datasets
    import easydel as ed
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    config = ed.LlamaConfig(**MODEL)  # EasyDeL's defaults otherwise: vanilla attention, its mesh
    with config.mesh:
        model = ed.LlamaForCausalLM(config=config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(1, MODEL["vocab_size"], (BATCH, LENGTH)).astype(np.int32)
    rows = np.tile(tokens, (SCHEDULE_STEPS, 1)).tolist()
    dataset = datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": np.ones_like(rows).tolist()})
    args = ed.TrainingArguments(
        save_directory=save_dir, total_batch_size=BATCH, max_length=LENGTH, num_train_epochs=1,
        max_training_steps=SCHEDULE_STEPS, learning_rate=LR, optimizer="adamw", scheduler="cosine",
        warmup_steps=WARMUP_STEPS, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_NORM, use_wandb=False,
        do_last_save=False, save_steps=None, resume_if_possible=False, shuffle_train_dataset=False,
        report_metrics=False, track_memory=False, progress_bar_type="json",
    )
    trainer = ed.Trainer(arguments=args, model=model, dataset_train=dataset)
    collate = trainer.data_collator or (lambda x: x)
    raw = collate(next(iter(trainer.dataloader_train)))  # what Trainer._train_epoch hands its step
    batch, _ = trainer._preprocess_batch_input(state=trainer.model_state, batch=raw, is_train=True)
    return trainer, jax.device_put(batch)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    import easydel as ed
    import jax

    with tempfile.TemporaryDirectory(prefix="bench_easydel_") as save_dir:
        trainer, batch = build(save_dir)
        # Trainer._execute_train_step's call, minus its per-step batch re-collation and hooks
        step = trainer.sharded_training_step_function
        static = (*trainer._train_shared_fn_extra_args, *trainer._train_shared_fn_static_args)
        state, losses, wall, cpu = trainer.model_state, [], [], []
        with trainer.mesh:  # as Trainer.train runs its epochs
            for _ in range(args.warmup + args.steps):
                t, c = time.perf_counter(), time.process_time()
                state, metrics = jax.block_until_ready(step(state, batch, *static))
                wall.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
                losses.append(float(metrics.loss))
    print(json.dumps({
        "batch": {k: [list(v.shape), str(v.dtype)] for k, v in batch.items() if hasattr(v, "shape")},
        "wall_s": statistics.median(wall[args.warmup:]), "cpu_s": statistics.median(cpu[args.warmup:]),
        "wall": wall, "cpu": cpu, "warmup": args.warmup, "losses": losses,
        "easydel": ed.__version__, "jax": jax.__version__,
        "attn_mechanism": str(trainer.model_state.model.config.attn_mechanism),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
