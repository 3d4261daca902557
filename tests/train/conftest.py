"""Shared pieces of the trainer tests: a tiny Llama, batches that follow the data contract."""

import numpy as np
import pytest

from shardzoo.models import get_model

# llama-tiny made smaller still: 4 heads of 8 and 4 kv heads (tensor=4 divides them), one layer;
# its 512-token vocabulary holds the byte tokenizer's, so command-line runs can train it too.
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4)


class ArrayBatches:
    """Seeded, endless, resumable batches per the data contract (numpy, [batch, length]).

    Each row counts up from a random start modulo ``vocab`` (learnable in a few steps);
    ``weights`` zero out a seeded random tenth of the tokens, so rows weigh differently.
    ``nan_at``: the batch at this position (0-based) has a NaN weight.
    """

    def __init__(self, batch_size=8, seq_len=16, vocab=64, seed=0, nan_at=None):
        self.batch_size, self.seq_len, self.vocab, self.seed = batch_size, seq_len, vocab, seed
        self.nan_at, self.position = nan_at, 0

    def __iter__(self):
        return self

    def __next__(self):
        rng = np.random.default_rng([self.seed, self.position])
        poisoned = self.position == self.nan_at
        self.position += 1
        b, n = self.batch_size, self.seq_len
        rows = (rng.integers(0, self.vocab, (b, 1)) + np.arange(n + 1)) % self.vocab
        weights = (rng.random((b, n)) > 0.1).astype(np.float32)
        if poisoned:
            weights[0, 0] = np.nan
        return {
            "inputs": rows[:, :-1].astype(np.int32),
            "targets": rows[:, 1:].astype(np.int32),
            "positions": np.broadcast_to(np.arange(n, dtype=np.int32), (b, n)).copy(),
            "segment_ids": np.ones((b, n), np.int32),
            "weights": weights,
        }

    def state(self):
        return {"position": self.position}

    def restore(self, state):
        self.position = state["position"]


@pytest.fixture(scope="session")
def tiny_lm():
    """(module, config) of a one-layer, 32-wide llama-tiny."""
    return get_model("llama-tiny", **TINY)


@pytest.fixture
def batches():
    """The ArrayBatches class."""
    return ArrayBatches


@pytest.fixture
def small():
    """The TrainConfig settings every in-process run shares (see SMALL)."""
    return dict(SMALL)


# In-process runs share one configuration, so their compiled programs coincide (the Trainer
# reuses the executable of an identical program): only the rule table and mesh vary. The
# command-line flags of test_train_nonfinite.py spell out the same run.
SMALL = dict(batch_size=32, seq_len=16, steps=8, lr=1e-2, warmup_steps=2, log_every=1, eval_every=0,
             eval_steps=2)


@pytest.fixture(scope="session")
def fsdp_run(tiny_lm, tmp_path_factory):
    """An uninterrupted 8-step fsdp run on fsdp=8 (checkpoints at 4 and 8, eval at the end):
    ``(trainer, history, out_dir)``."""
    from shardzoo.sharding import get_rules, make_mesh
    from shardzoo.train.config import TrainConfig
    from shardzoo.train.trainer import Trainer

    module, config = tiny_lm
    out = tmp_path_factory.mktemp("fsdp_run")
    cfg = TrainConfig(out=str(out), save_every=4, keep=3, **SMALL)
    trainer = Trainer(module, config, cfg, make_mesh("fsdp=8"), get_rules("fsdp"), ArrayBatches(32, 16),
                      ArrayBatches(32, 16, seed=9), meta={"model": "llama-tiny"})
    history = trainer.fit()
    return trainer, history, out
