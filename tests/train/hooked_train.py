"""``shardzoo train`` with test hooks: ``python hooked_train.py [--hash] [--delay S] [--nan-at N] -- ARGS``.

The hooks come in through the Trainer's ``hooks`` (``train.trainer.Hook``), never through the
production flags or the jitted step: ``--hash`` logs each step's batch hash to metrics.jsonl,
``--delay`` sleeps after each step (time to send a signal), ``--nan-at`` makes one weight of
that step's batch NaN (a non-finite loss and gradient).
"""

import argparse
import sys
import time

import numpy as np

from shardzoo.cli import build_parser, report_train
from shardzoo.errors import UserError
from shardzoo.train.flags import config_from_args
from shardzoo.train.launch import run
from shardzoo.train.trainer import Hook, batch_hash


class BatchHash(Hook):
    def after_step(self, trainer, step, batch, record):
        record["batch_hash"] = batch_hash(batch)


class Delay(Hook):
    def __init__(self, seconds):
        self.seconds = seconds

    def after_step(self, trainer, step, batch, record):
        time.sleep(self.seconds)


class NanAt(Hook):
    def __init__(self, step):
        self.step = step

    def before_step(self, trainer, step, batch):
        if step != self.step:
            return batch
        weights = np.array(batch["weights"], np.float32)
        weights.flat[0] = np.nan
        return {**batch, "weights": weights}


def main(argv):
    split = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("--hash", action="store_true")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--nan-at", type=int, default=None)
    opts = p.parse_args(argv[:split])
    hooks = ([BatchHash()] if opts.hash else []) + ([Delay(opts.delay)] if opts.delay else [])
    hooks += [NanAt(opts.nan_at)] if opts.nan_at is not None else []
    try:
        cfg = config_from_args(build_parser().parse_args(["train", *argv[split + 1:]]))
        return report_train(run(cfg, hooks=hooks))
    except UserError as e:
        print(f"shardzoo train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
