"""The step ``shardzoo train`` runs, for the benchmarks: a Program and a data-contract batch.

``one_device_program`` builds the ``run_program`` of a training run's settings on one device
(rules dp); ``packed_batch`` is a batch per the data contract with two documents packed in
every row (segment ids 1 and 2, positions restarting, no loss weight across the seam), so the
timed step takes the attention branch that training takes; ``stepper`` runs the program's own
compiled step on it.
"""

from __future__ import annotations

import jax
import numpy as np

from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.config import TrainConfig
from shardzoo.train.tasks.registry import run_program


def one_device_program(config, batch: int, seq_len: int, **settings):
    """The Program of ``shardzoo train --batch-size batch --seq-len seq_len`` (plus ``settings``,
    TrainConfig fields) on one device."""
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    return run_program(TrainConfig(batch_size=batch, seq_len=seq_len, **settings), config,
                       get_rules("dp"), mesh)


def packed_batch(vocab: int, batch: int, seq_len: int, seed: int = 0) -> dict:
    """Two documents per row (the first ``seq_len // 2`` tokens, then the rest)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, (batch, seq_len + 1)).astype(np.int32)
    half = seq_len // 2
    cols = np.arange(seq_len)
    segment_ids = np.broadcast_to(np.where(cols < half, 1, 2), (batch, seq_len)).astype(np.int32)
    positions = np.broadcast_to(np.where(cols < half, cols, cols - half), (batch, seq_len)).astype(np.int32)
    weights = np.ones((batch, seq_len), np.float32)
    weights[:, [half - 1, seq_len - 1]] = 0.0  # the last token of each document has no target
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": positions.copy(),
            "segment_ids": segment_ids.copy(), "weights": weights}


def stepper(program, state, batch: dict, rng=None):
    """A no-argument callable: one step of the program's compiled train step, run to completion
    (``state`` is donated and replaced each call); ``run.state`` is the latest state and
    ``run.metrics`` the latest metrics."""
    step = program.compiled_train_step()
    placed = program.place(batch)
    rng = jax.random.PRNGKey(0) if rng is None else rng

    def run():
        run.state, run.metrics = step(run.state, placed, rng)
        jax.block_until_ready(run.metrics["loss"])

    run.state, run.metrics = state, None
    return run


def cpu_model() -> str:
    """This machine's CPU model (/proc/cpuinfo's "model name"), recorded beside every CPU figure."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()
