"""``shardzoo train``: resolve and check every input, then write OUT and run the Trainer.

Everything the user gave (model, overrides, rules, mesh, data, tokenizer, an existing run in
``--out``, ``--init-from``) is resolved and validated before anything is written, so a bad
input leaves an existing ``--out`` untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys

import jax
import numpy as np

from shardzoo import host_memory, interrupt
from shardzoo.errors import UserError
from shardzoo.models import apply_overrides, get_model, parse_overrides
from shardzoo.sharding.mesh import describe_mesh
from shardzoo.sharding.rules import get_rules
from shardzoo.train import fit, model_info
from shardzoo.train.config import ConfigError, TrainConfig
from shardzoo.train.defaults import STDLIB_EVAL_FRACTION, adds_bos, mesh_and_rules, pad_vocab
from shardzoo.train.distributed import init_distributed
from shardzoo.train.io import outdir
from shardzoo.train.io.checkpoint import (
    CHECKPOINTS,
)
from shardzoo.train.io.hub import is_hub_id
from shardzoo.train.io.lora_io import initial_params, lora_lines, with_lora
from shardzoo.train.io.rundir import DirLock, check_run_dir
from shardzoo.train.io.runmeta import model_meta, recorded_remat
from shardzoo.train.io.sources import open_source
from shardzoo.train.metrics import set_aside_orphans, signal_keys
from shardzoo.train.optim import warmup_note
from shardzoo.train.tasks.base import model_task
from shardzoo.train.tasks.preference import check_reference, load_reference
from shardzoo.train.tasks.registry import run_program, run_task
from shardzoo.train.trainer import NonFiniteError, is_main_process, say
from shardzoo.train.xla_flags import apply_xla_preset


def with_init_model(cfg: TrainConfig):
    """``(cfg, config, model meta)``: with ``--init-from``, the model its source holds (an HF
    dir, a run or a step; ``sources.open_source``) with the user's ``--override``s applied, its
    tokenizer unless ``--tokenizer`` names another than byte, and ``cfg.model`` the zoo preset it
    started from (None if none); without, ``(cfg, None, {})`` and ``--model`` builds the model."""
    if not cfg.init_from:
        return cfg, None, {}
    source = open_source(cfg.init_from, what="--init-from")
    config = apply_overrides(source.config, parse_overrides(cfg.override), where="--override")
    tokenizer = source.tokenizer or "byte"
    if cfg.tokenizer not in (None, "byte"):
        tokenizer = cfg.tokenizer
    add_bos = cfg.add_bos or (tokenizer != "byte" and adds_bos(tokenizer))
    cfg = dataclasses.replace(cfg, model=source.model, tokenizer=tokenizer, add_bos=add_bos)
    return cfg, config, {"model": source.model, "family": source.family,
                         "hf_config": source.meta.get("hf_config")}


@dataclasses.dataclass
class Prepared:
    """A validated run: everything resolved, nothing written yet."""

    cfg: TrainConfig
    out: str
    module: object
    config: object
    rules: object
    opt_rules: object
    mesh: object
    tokenizer: object
    train_data: object
    eval_data: object
    resume_step: int | None
    program: object  # the run's train.program.Program: validated, planned; compiled when its fit was checked
    notes: tuple[str, ...] = ()  # lines to print before training (e.g. a resume onto another mesh)
    device_memory: tuple[str, int] | None = None  # (label, bytes) one device may use; None: unknown


def prepare(cfg: TrainConfig, config=None) -> Prepared:
    """Resolve and check every input of a run, last the train step's fit to the device's memory
    (``train/fit.py``: compiled, ``--remat auto`` chosen); raises a UserError naming the first
    bad one. ``config``: the model ``--init-from`` named (``with_init_model``), else ``--model``.
    The returned ``cfg`` names the concrete remat policy, never "auto"."""
    import datasets

    from shardzoo.data import load_tokenizer, make_labelled_datasets

    if not sys.stderr.isatty():  # keep a user error one line on a log
        datasets.disable_progress_bars()
    if not cfg.out:
        raise ConfigError("--out DIR is required")
    out = os.path.abspath(os.path.expanduser(cfg.out))
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out}: exists and is not a directory")
    checkpoints = os.path.join(out, CHECKPOINTS)
    if os.path.lexists(checkpoints) and not os.path.isdir(checkpoints):
        raise ConfigError(f"{checkpoints} exists and is not a directory: move it away or choose another --out")
    check_run_dir(out)
    if config is None:
        _, config = get_model(cfg.model, **parse_overrides(cfg.override))
    component = run_task(cfg)
    config = component.model(cfg, with_lora(cfg, config))  # --lora-*: the adapted model; the task's own
    labelled = model_info.task(config) != "lm"
    if labelled != (cfg.label_column is not None):
        raise ConfigError(
            f"--model {cfg.model} (task {config.task!r}) trains on labelled examples: give --data "
            "and --label-column" if labelled else
            f"--label-column {cfg.label_column}: --model {cfg.model} is a language model; "
            "labelled examples train a classification or regression model (e.g. mlp-mnist)")
    max_len = model_info.max_positions(config)
    if max_len is not None and cfg.seq_len > max_len:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_position_embeddings {max_len}")
    mesh, rules = mesh_and_rules(cfg.mesh, cfg.rules)
    config, vocab_note = pad_vocab(config, rules, mesh)
    opt_rules = get_rules(cfg.opt_rules) if cfg.opt_rules else None
    memory = fit.device_memory(cfg)
    remat = fit.requested_remat(cfg, config, accelerator=jax.devices()[0].platform != "cpu")
    component.check(cfg)
    program = _program(cfg, config, rules, opt_rules, mesh)
    if cfg.reference:
        check_reference(cfg.reference, config)

    tokenizer = None if labelled else load_tokenizer(cfg.tokenizer)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ConfigError(f"tokenizer {cfg.tokenizer!r} has {tokenizer.vocab_size} ids but model "
                          f"{_model_name(cfg)!r} has vocab_size {config.vocab_size}")
    resume_step, notes = outdir.check_resume(cfg, out, config, tokenizer, mesh, rules)
    data_config = data_config_of(cfg)
    if labelled:
        train_data, eval_data = make_labelled_datasets(data_config, cfg.batch_size, mesh=mesh,
                                                       rules=rules, seed=cfg.seed)
        _check_labelled(cfg, config, train_data)
        _check_same_classes(cfg, out, resume_step, train_data)
    else:
        train_data, eval_data = component.datasets(cfg, data_config, tokenizer, mesh, rules, program)
    if resume_step is not None and cfg.steps <= resume_step:  # nothing to do: nothing to compile
        fitted = fit.Fitted(program, config, cfg.remat)
    else:
        recorded = None
        if resume_step is not None:
            from shardzoo.train.io.checkpoint import read_meta

            recorded = recorded_remat(read_meta(checkpoints, resume_step))
        build = lambda c: program if c == config else _program(cfg, c, rules, opt_rules, mesh)  # noqa: E731
        fitted = fit.fit_step(cfg, config, build, memory, remat, recorded=recorded)
    notes += (fitted.line,) if fitted.line else ()
    if model_info.lora_rank(config):  # what is adapted and what is not, before training
        notes = (*lora_lines(config), *notes)
    if vocab_note:
        notes = (vocab_note, *notes)
    return Prepared(dataclasses.replace(cfg, remat=fitted.remat), out, fitted.program.module, fitted.config,
                    rules, opt_rules, mesh, tokenizer, train_data, eval_data, resume_step, fitted.program, notes,
                    memory)


def data_config_of(cfg: TrainConfig):
    """The ``data.DataConfig`` of a run's settings (the held-out fraction defaulted)."""
    from shardzoo.data import DataConfig

    eval_fraction = cfg.eval_fraction
    if eval_fraction is None:
        eval_fraction = STDLIB_EVAL_FRACTION if cfg.data == "stdlib" and not cfg.eval_data else 0.0
    data_fields = {f.name for f in dataclasses.fields(DataConfig)}
    data = {k: v for k, v in cfg.section("data").items() if k in data_fields}
    component = run_task(cfg)
    return DataConfig(**{**data, "eval_fraction": eval_fraction, "preference": component.preference,
                         "unpaired": component.unpaired})


def _check_labelled(cfg, config, data) -> None:
    """The labelled data must fit the model: as many features as its inputs, labels it can output."""
    if data.task != config.task:
        raise ConfigError(f"--label-column {cfg.label_column}: the labels are for {data.task}, "
                          f"--model {cfg.model} does {config.task}")
    if data.num_features != config.in_features:
        raise ConfigError(f"--data {cfg.data}: {data.num_features} features per example, --model "
                          f"{cfg.model} takes in_features={config.in_features} "
                          f"(--override in_features={data.num_features})")
    task, wanted = model_task(config), data.num_outputs
    if not task.learns(wanted, config.num_outputs):
        raise ConfigError(f"--label-column {cfg.label_column}: {wanted} {task.outputs_are}, --model "
                          f"{cfg.model} has num_outputs={config.num_outputs} "
                          f"(--override num_outputs={wanted})")


def _check_same_classes(cfg, out, resume_step, data) -> None:
    """A resumed classification run must see the class names it was trained on: the ids of
    string labels follow the names present in the data."""
    if resume_step is None or data.num_classes is None:  # regression: no classes
        return
    from shardzoo.train.io.checkpoint import read_meta

    recorded = (read_meta(os.path.join(out, CHECKPOINTS), resume_step).get("classes") or {}).get("names")
    names = list(data.label_names) if data.label_names else None
    if recorded is not None and recorded != names:
        raise ConfigError(f"--data {cfg.data}: label column {cfg.label_column!r} has the classes "
                          f"{', '.join(names or ['(class ids)'])}, the run in {out} was trained on "
                          f"{', '.join(recorded)}: resume with data of those classes or choose another --out")


def _model_name(cfg) -> str:
    """The zoo preset, or the directory ``--init-from`` took the model from."""
    return cfg.model or os.path.basename(os.path.normpath(cfg.init_from))


def _program(cfg, config, rules, opt_rules, mesh):
    """The run's one program, validated strictly: a rule that cannot apply is an error."""
    from shardzoo.sharding.validate import ShardingValidationError

    try:
        return run_program(cfg, config, rules, mesh, opt_rules=opt_rules)
    except ShardingValidationError as e:
        raise ConfigError(e.summary(f"rules {rules.name!r} on mesh {describe_mesh(mesh)}: ")) from None


def _write_json(path: str, value) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _agree(fn):
    """``fn()`` on every process; when it raises a UserError on one, every process raises (so no
    process waits in a collective for a peer that has given up)."""
    try:
        result, error = fn(), None
    except UserError as e:
        result, error = None, e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = np.asarray(multihost_utils.process_allgather(np.asarray(error is not None, np.int32)))
        if error is None and failed.any():
            error = UserError(f"process {int(np.argmax(failed))} of this run stopped with an error (see its output)")
    if error is not None:
        raise error
    return result


class _Undo:
    """What ``--out`` held before this command wrote to it: ``restore()`` removes every file and
    directory it added and puts back, byte for byte, the files a run's start rewrites (run.json,
    metrics.jsonl); the lock file is the lock's."""

    def __init__(self, out: str):
        from shardzoo.train.io.rundir import LOCK_FILE
        from shardzoo.train.metrics import METRICS_FILE

        self.out = out
        self.paths = self._paths() | {LOCK_FILE}
        self.saved = {}
        for name in ("run.json", METRICS_FILE):  # what a run's start rewrites
            path = os.path.join(out, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    self.saved[path] = f.read()

    def _paths(self) -> set[str]:
        found = set()
        for root, dirs, files in os.walk(self.out):
            found.update(os.path.relpath(os.path.join(root, n), self.out) for n in dirs + files)
        return found

    def restore(self) -> None:
        import shutil

        for name in sorted(self._paths() - self.paths):  # a new directory comes before what is in it
            path = os.path.join(self.out, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                os.remove(path)
        for path, data in self.saved.items():
            with open(path, "wb") as f:
                f.write(data)


DONE, PREEMPTED, NOTHING_TO_DO, INTERRUPTED, NONFINITE = (
    "done", "preempted", "nothing to do", "interrupted", "non-finite")


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How a run ended: ``status`` (DONE, PREEMPTED by SIGTERM, NOTHING_TO_DO, INTERRUPTED by
    Ctrl-C, NONFINITE), the ``step`` it stopped at, its last logged ``loss``, the ``checkpoint``
    it left, and ``message``, the line that says so (the command line prints it, on stderr for
    INTERRUPTED and NONFINITE, and picks the exit status). ``main_process``: whether this
    process is the one that speaks for the run."""

    status: str
    out: str
    step: int | None = None
    loss: float | None = None
    checkpoint: str | None = None
    message: str = ""
    main_process: bool = True


def run(cfg: TrainConfig, hooks=(), log=None) -> RunResult:
    """Lock --out, validate, then train; returns how the run ended (``RunResult``) and raises a
    UserError (or EnvironmentFault) for a bad input (or a failed disk).

    ``hooks``: ``trainer.Hook`` objects the Trainer calls around every step. ``log``: where the
    progress lines go (the rule table, the plan, resumes; process 0 only), default stdout."""
    xla_flags = apply_xla_preset(cfg.xla_preset)  # before anything starts a backend
    if cfg.compile_cache:  # jax's persistent cache: later runs of the same program skip XLA
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(cfg.compile_cache))
    init_distributed(cfg)
    if not cfg.out:
        raise ConfigError("--out DIR is required")
    outdir.check_out(cfg.out)  # before the lock, which creates --out
    emit = log or say
    log = (lambda line: emit(line)) if is_main_process() else (lambda line: None)
    # process 0 holds the lock for the whole run; a second run on --out stops here
    lock = DirLock(cfg.out, "--out") if is_main_process() else None
    _agree(lambda: lock and lock.acquire())
    try:
        with interrupt.undone(lock.release if lock is not None else lambda: None):  # a Ctrl-C at start-up
            return _run(cfg, hooks, xla_flags, log)
    finally:
        if lock is not None:
            lock.release()


def _run(cfg: TrainConfig, hooks, xla_flags: str, log) -> RunResult:
    main = is_main_process()
    cfg, init_config, init_meta = _agree(lambda: with_init_model(cfg))  # --init-from: its model
    p = _agree(lambda: prepare(cfg, init_config))
    cfg = dataclasses.replace(p.cfg, out=p.out)
    checkpoints = os.path.join(p.out, CHECKPOINTS)
    if p.resume_step is not None and cfg.steps <= p.resume_step:
        return RunResult(NOTHING_TO_DO, p.out, p.resume_step,
                         checkpoint=os.path.join(checkpoints, str(p.resume_step)),
                         message=f"{p.out} is at step {p.resume_step} and --steps is {cfg.steps}: "
                                 f"nothing to do (raise --steps to train further)", main_process=main)
    rules_spec = cfg.rules or p.rules.name
    meta = {**model_meta(p.config, cfg.model, init_meta.get("family"), init_meta.get("hf_config")),
            "overrides": parse_overrides(cfg.override), "rules": rules_spec,
            "opt_rules": cfg.opt_rules, "tokenizer": p.tokenizer.spec if p.tokenizer else None,
            "tokenizer_saved": p.tokenizer is not None, "data": cfg.data,
            "seq_len": cfg.seq_len, "batch_size": cfg.batch_size}
    if model_info.task(p.config) == "classification":  # string labels map back to these names
        names = p.train_data.label_names
        meta["classes"] = {"num_classes": p.train_data.num_classes, "names": list(names) if names else None}
    if model_info.lora_rank(p.config):  # the base the adapters belong to (also stored whole)
        base = cfg.model if not cfg.init_from else cfg.init_from if is_hub_id(cfg.init_from) \
            else os.path.abspath(cfg.init_from)
        meta["lora"] = {"base": base, "adapters_from": cfg.lora_from and os.path.abspath(cfg.lora_from)}
    undo = _Undo(p.out) if main else None  # a step out of memory at its start leaves --out as it was
    orphans = None  # metrics.jsonl rows of no checkpoint, set aside by a fresh start
    if main:  # validated: from here on we write (a Ctrl-C waits for these writes: the resume reads them)
        with interrupt.uncut():
            os.makedirs(p.out, exist_ok=True)
            tokenizer_dir = os.path.join(p.out, "tokenizer")
            # a resume keeps the run's tokenizer files (checked equal above)
            if p.tokenizer is not None and (p.resume_step is None or not os.path.isdir(tokenizer_dir)):
                p.tokenizer.save(tokenizer_dir)
            orphans = None if p.resume_step is not None or cfg.restart else set_aside_orphans(p.out)
            _write_json(os.path.join(p.out, "run.json"), {
                **meta, "mesh": describe_mesh(p.mesh), "devices": jax.device_count(),
                "processes": jax.process_count(), "xla_flags": xla_flags, "host_malloc": host_memory.setting(),
                "settings": cfg.to_sections(),
            })
    reference_params = None  # dpo: --reference, else --init-from (on a resume too), else the seed's init
    component = run_task(cfg)
    frozen = component.frozen_params(cfg, p.program)  # distillation's teacher
    if frozen is not None:
        reference_params = frozen
    elif cfg.reference:
        reference_params = lambda target: load_reference(cfg.reference, target, p.config)
    elif cfg.init_from:
        reference_params = lambda target: initial_params(cfg, target, p.config, p.mesh, p.rules,
                                                         init_meta.get("family"))
    init_params = None
    if cfg.init_from and p.resume_step is None:
        init_params = lambda target: initial_params(cfg, target, p.config, p.mesh, p.rules,
                                                    init_meta.get("family"))
    for note in (*p.notes, orphans, warmup_note(cfg)):
        if note:
            log(note)
    log(str(p.rules))
    if p.opt_rules is not None:
        log(f"optimizer state: {p.opt_rules}")
    log(p.program.plan(device_memory=p.device_memory, name=_model_name(cfg)).format())
    trainer = saved_at_start = None
    try:
        trainer = component.trainer(cfg)(p.module, p.config, cfg, p.mesh, p.rules, p.train_data, p.eval_data,
                                opt_rules=p.opt_rules, meta=meta, init_params=init_params, hooks=hooks,
                                program=p.program, log=log, reference_params=reference_params)
        saved_at_start = trainer.last_saved
        log(trainer.describe())
        log(f"compiled the train step in {trainer.compile_seconds:.1f}s; "
            f"training steps {trainer.start_step + 1}..{cfg.steps} to {p.out}")
        history = trainer.fit()
    except NonFiniteError as e:
        saved = None if e.last_checkpoint is None else os.path.join(checkpoints, str(e.last_checkpoint))
        return RunResult(NONFINITE, p.out, e.step, checkpoint=saved, message=str(e), main_process=main)
    except Exception as e:
        if not fit.is_out_of_memory(e):
            raise
        if undo is not None and (trainer is None or trainer.last_saved == saved_at_start):
            undo.restore()  # nothing new to keep: no step of this command was saved
        raise fit.StepDoesNotFit(fit.out_of_memory_message(cfg, p.config, p.device_memory, e)) from None
    saved = os.path.join(checkpoints, str(trainer.last_saved))
    last = next((r for r in reversed(history) if "loss" in r), None)
    loss = last["loss"] if last else None
    if trainer.stop_signal == signal.SIGINT:
        return RunResult(INTERRUPTED, p.out, trainer.final_step, loss, saved,
                         f"saved step {trainer.final_step} to {saved}; run the same command to resume",
                         main_process=main)
    status = PREEMPTED if trainer.stop_signal == signal.SIGTERM else DONE
    summary = f"; loss {loss:.4f}" if loss is not None else ""
    for key in signal_keys(trainer.program.task.signals, last or {}):  # what the task learns from
        summary += f", {key} {last[key]:.4f}" if isinstance(last[key], float) else ""
    return RunResult(status, p.out, trainer.final_step, loss, saved,
                     f"stopped at step {trainer.final_step}{summary}; checkpoint {saved}", main_process=main)
