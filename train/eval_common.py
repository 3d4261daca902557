"""What every ``shardzoo eval`` task reads: the run's recorded settings and data, and the
progress bar."""

from __future__ import annotations

import dataclasses

import jax

from shardzoo.data import DataConfig
from shardzoo.errors import UserError
from shardzoo.train import model_info
from shardzoo.train.defaults import DEFAULT_SEQ_LEN, STDLIB_EVAL_FRACTION, adds_bos
from shardzoo.train.metrics import progress
from shardzoo.train.program import Program

DATA_FIELDS = {f.name for f in dataclasses.fields(DataConfig)}


def eval_progress(total: int | None, desc: str):
    """``metrics.progress``: a bar on stderr when it is a terminal, from process 0 only."""
    return progress(total, desc, jax.process_index() == 0)



def run_settings(checkpoint: str) -> dict:
    """The data settings (``data``, columns, ``eval_fraction``, ``add_bos``, ``seq_len``) and
    ``seed`` a run recorded in its run.json; empty when it has none (e.g. an import-hf dir)."""
    from shardzoo.train.io.sources import READS_RUNS, open_source

    return open_source(checkpoint, what="--checkpoint", accept=READS_RUNS).run_settings()


def run_json(checkpoint: str) -> dict:
    """The whole run.json of a --checkpoint run ({} for a source without one)."""
    from shardzoo.train.io.rundir import RunDirError, read_run_json
    from shardzoo.train.io.sources import READS_RUNS, open_source

    source = open_source(checkpoint, what="--checkpoint", accept=READS_RUNS)
    try:
        run = read_run_json(source.run_dir)
    except RunDirError:
        return {}  # run_settings (next) names a damaged run.json
    return run if isinstance(run, dict) else {}


def data_config_of_eval(s, run: dict, tokenizer, add_bos: bool):
    """``(data config, split)`` of an lm eval: the flags, else what the run recorded (its eval
    fraction only for the run's own data); ``--split eval`` of a run that held out
    ``--eval-data`` is all of that data."""
    data, split = s.data or run.get("data"), s.split
    if split == "eval" and s.data is None and s.eval_fraction is None and run.get("eval_data"):
        data, split = run["eval_data"], "all"
    same = data == run.get("data")
    fraction = s.eval_fraction if s.eval_fraction is not None else run.get("eval_fraction") if same else None
    if fraction is None:  # what `shardzoo train` holds out of the embedded corpus by default
        fraction = STDLIB_EVAL_FRACTION if data == "stdlib" and not (same and run.get("eval_data")) else 0.0
    flags = {"text_column": s.text_column, "prompt_column": s.prompt_column,
             "completion_column": s.completion_column, "chat_column": s.chat_column}
    if any(v is not None for v in flags.values()):
        layout = {k: v for k, v in flags.items() if v is not None}
    else:  # the run's columns and row layout (data of the same layout), else the text column
        own = {"data", "eval_data", "eval_fraction", "tokenizer", "add_bos", "cache_dir"}
        layout = {k: v for k, v in run.items() if k in DATA_FIELDS - own}
    config = DataConfig(data=data, eval_fraction=fraction, tokenizer=tokenizer.spec, add_bos=add_bos,
                        **layout)
    return config, split


def text_program(s, recorded: dict, config, params, mesh, rules, tokenizer, default_len):
    """``(program, params placed on it, add_bos)`` of a language model's eval: ``--batch-size``
    (default: 8 rows a device at most), ``--seq-len`` (default ``default_len(add_bos,
    max_len)``) within the model's positions."""
    add_bos = s.add_bos or recorded.get("add_bos", adds_bos(tokenizer))
    max_len = model_info.max_positions(config) or DEFAULT_SEQ_LEN
    if s.seq_len is not None and s.seq_len > max_len:
        raise UserError(f"--seq-len {s.seq_len} exceeds the model's max_position_embeddings {max_len}")
    batch_size = s.batch_size or mesh.size * max(1, 8 // mesh.size)
    program = Program(config, rules, mesh, batch_size=batch_size, seq_len=s.seq_len or default_len(add_bos, max_len))
    return program, jax.device_put(params, program.shardings.params), add_bos
