"""``shardzoo train``: resolve and check every input, then write OUT and run the Trainer.

Everything the user gave (model, overrides, rules, mesh, data, tokenizer, an existing run in
``--out``, ``--init-from``) is resolved and validated before anything is written, so a bad
input leaves an existing ``--out`` untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax

from shardzoo.errors import UserError
from shardzoo.models import get_model, parse_overrides
from shardzoo.sharding.mesh import describe_mesh, make_mesh
from shardzoo.sharding.rules import get_rules
from shardzoo.train.checkpoint import (
    CHECKPOINTS,
    check_same_model,
    config_to_dict,
    hf_module,
    init_params_from,
    latest_step,
    model_meta,
    read_meta,
    resolve_checkpoint,
)
from shardzoo.train.config import NONFINITE_EXIT, ConfigError, TrainConfig
from shardzoo.train.program import run_program
from shardzoo.train.trainer import NonFiniteError, Trainer, is_main_process, say

STDLIB_EVAL_FRACTION = 0.05  # held out of the embedded corpus when no eval data is named


def init_distributed(cfg: TrainConfig) -> None:
    """``jax.distributed.initialize`` from the multi-host flags; call before touching devices."""
    explicit = (cfg.coordinator, cfg.num_processes, cfg.process_id)
    timeouts = dict(initialization_timeout=cfg.distributed_timeout,
                    heartbeat_timeout_seconds=cfg.heartbeat_timeout)
    if any(v is not None for v in explicit):
        if None in explicit:
            raise ConfigError("--coordinator, --num-processes and --process-id go together")
        jax.distributed.initialize(coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
                                   process_id=cfg.process_id, **timeouts)
    elif cfg.distributed:
        jax.distributed.initialize(**timeouts)


def default_rules(num_devices: int) -> str:
    return "fsdp" if num_devices > 1 else "dp"


def default_mesh(rules) -> str:
    return "fsdp=-1" if "fsdp" in rules.mesh_axes_used() else "data=-1"


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
    program: object  # the run's train.program.Program: validated, planned, not yet compiled


def prepare(cfg: TrainConfig, config=None) -> Prepared:
    """Resolve and check every input of a run; raises a UserError naming the first bad one.
    ``config``: the model ``--init-from`` named (``hf_io.with_init_model``), else ``--model``."""
    import datasets

    from shardzoo.data import DataConfig, load_tokenizer, make_datasets, make_labelled_datasets

    if not sys.stderr.isatty():  # keep a user error one line on a log
        datasets.disable_progress_bars()
    if not cfg.out:
        raise ConfigError("--out DIR is required")
    out = os.path.abspath(os.path.expanduser(cfg.out))
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out}: exists and is not a directory")
    if config is None:
        module, config = get_model(cfg.model, **parse_overrides(cfg.override))
    else:
        module = config.build()
    labelled = config.task != "lm"
    if labelled != (cfg.label_column is not None):
        raise ConfigError(
            f"--model {cfg.model} (task {config.task!r}) trains on labelled examples: give --data "
            "and --label-column" if labelled else
            f"--label-column {cfg.label_column}: --model {cfg.model} is a language model; "
            "labelled examples train a classification or regression model (e.g. mlp-mnist)")
    max_len = getattr(config, "max_position_embeddings", None)
    if max_len is not None and cfg.seq_len > max_len:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_position_embeddings {max_len}")
    rules = get_rules(cfg.rules or default_rules(jax.device_count()))
    opt_rules = get_rules(cfg.opt_rules) if cfg.opt_rules else None
    mesh = make_mesh(cfg.mesh or default_mesh(rules))
    program = _program(cfg, config, module, rules, opt_rules, mesh)

    resume_step = latest_step(os.path.join(out, CHECKPOINTS))
    if resume_step is not None:
        where = os.path.join(out, CHECKPOINTS, str(resume_step))
        check_same_model(read_meta(os.path.join(out, CHECKPOINTS), resume_step), cfg.model,
                         config_to_dict(config), cfg.optimizer, where)
    elif cfg.init_from:
        _check_init_from(cfg.init_from)

    eval_fraction = cfg.eval_fraction
    if eval_fraction is None:
        eval_fraction = STDLIB_EVAL_FRACTION if cfg.data == "stdlib" and not cfg.eval_data else 0.0
    data_fields = {f.name for f in dataclasses.fields(DataConfig)}
    data = {k: v for k, v in cfg.section("data").items() if k in data_fields}
    data_config = DataConfig(**{**data, "eval_fraction": eval_fraction})
    if labelled:
        tokenizer = None
        train_data, eval_data = make_labelled_datasets(data_config, cfg.batch_size, mesh=mesh,
                                                       rules=rules, seed=cfg.seed)
        _check_labelled(cfg, config, train_data)
    else:
        tokenizer = load_tokenizer(cfg.tokenizer)
        if tokenizer.vocab_size > config.vocab_size:
            raise ConfigError(f"tokenizer {cfg.tokenizer!r} has {tokenizer.vocab_size} ids but model "
                              f"{_model_name(cfg)!r} has vocab_size {config.vocab_size}")
        train_data, eval_data = make_datasets(data_config, tokenizer, cfg.seq_len, cfg.batch_size,
                                              mesh=mesh, rules=rules, seed=cfg.seed)
    return Prepared(cfg, out, module, config, rules, opt_rules, mesh, tokenizer, train_data, eval_data,
                    resume_step, program)


def _check_labelled(cfg, config, data) -> None:
    """The labelled data must fit the model: as many features as its inputs, labels it can output."""
    if data.task != config.task:
        raise ConfigError(f"--label-column {cfg.label_column}: the labels are for {data.task}, "
                          f"--model {cfg.model} does {config.task}")
    if data.num_features != config.in_features:
        raise ConfigError(f"--data {cfg.data}: {data.num_features} features per example, --model "
                          f"{cfg.model} takes in_features={config.in_features} "
                          f"(--override in_features={data.num_features})")
    wanted = data.num_classes if data.task == "classification" else data.num_outputs
    if (wanted > config.num_outputs) if data.task == "classification" else (wanted != config.num_outputs):
        raise ConfigError(f"--label-column {cfg.label_column}: {wanted} "
                          f"{'classes' if data.task == 'classification' else 'outputs'}, --model "
                          f"{cfg.model} has num_outputs={config.num_outputs} "
                          f"(--override num_outputs={wanted})")


def _model_name(cfg) -> str:
    """The zoo preset, or the directory ``--init-from`` took the model from."""
    return cfg.model or os.path.basename(os.path.normpath(cfg.init_from))


def _check_init_from(path: str) -> None:
    hf = hf_module()
    if hf is not None and os.path.isdir(path) and hf.is_hf_dir(path):
        return
    try:
        resolve_checkpoint(path)
    except UserError as e:
        raise ConfigError(f"--init-from {e}") from None


def _program(cfg, config, module, rules, opt_rules, mesh):
    """The run's one program, validated strictly: a rule that cannot apply is an error."""
    from shardzoo.sharding.validate import ShardingValidationError

    try:
        return run_program(cfg, config, rules, mesh, opt_rules=opt_rules, module=module)
    except ShardingValidationError as e:
        raise ConfigError(e.summary(f"rules {rules.name!r} on mesh {describe_mesh(mesh)}: ")) from None


def _write_json(path: str, value) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def run(cfg: TrainConfig, hooks=()) -> int:
    """Validate, then train; 0 when done or preempted, NONFINITE_EXIT on a NaN/Inf step.

    ``hooks``: ``trainer.Hook`` objects the Trainer calls around every step."""
    if cfg.compile_cache:  # jax's persistent cache: later runs of the same program skip XLA
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(cfg.compile_cache))
    init_distributed(cfg)
    from shardzoo.train.hf_io import with_init_model

    cfg, init_config, init_meta = with_init_model(cfg)  # --init-from: its config and tokenizer
    p = prepare(cfg, init_config)
    cfg = dataclasses.replace(cfg, out=p.out)
    rules_spec = cfg.rules or p.rules.name
    meta = {**model_meta(p.config, cfg.model, init_meta.get("family")),
            "overrides": parse_overrides(cfg.override), "rules": rules_spec,
            "opt_rules": cfg.opt_rules, "tokenizer": p.tokenizer.spec if p.tokenizer else None,
            "tokenizer_saved": p.tokenizer is not None, "data": cfg.data}
    if is_main_process():  # validated: from here on we write
        os.makedirs(p.out, exist_ok=True)
        if p.tokenizer is not None:
            p.tokenizer.save(os.path.join(p.out, "tokenizer"))
        _write_json(os.path.join(p.out, "run.json"), {
            **meta, "mesh": describe_mesh(p.mesh), "devices": jax.device_count(),
            "processes": jax.process_count(), "settings": cfg.to_sections(),
        })
    init_params = None
    if cfg.init_from and p.resume_step is None:
        init_params = lambda target: init_params_from(cfg.init_from, target, p.config, p.mesh, p.rules)
    say(str(p.rules))
    if p.opt_rules is not None:
        say(f"optimizer state: {p.opt_rules}")
    say(p.program.plan(name=_model_name(cfg)).format())
    trainer = Trainer(p.module, p.config, cfg, p.mesh, p.rules, p.train_data, p.eval_data,
                      opt_rules=p.opt_rules, meta=meta, init_params=init_params, hooks=hooks,
                      program=p.program)
    say(trainer.describe())
    say(f"compiled the train step in {trainer.compile_seconds:.1f}s; "
        f"training steps {trainer.start_step + 1}..{cfg.steps} to {p.out}")
    try:
        history = trainer.fit()
    except NonFiniteError as e:
        if is_main_process():
            print(f"shardzoo train: error: {e}", file=sys.stderr, flush=True)
        return NONFINITE_EXIT
    last = next((r for r in reversed(history) if "loss" in r), None)
    summary = f"; loss {last['loss']:.4f}" if last else ""
    say(f"stopped at step {trainer.final_step}{summary}; checkpoint {p.out}/{CHECKPOINTS}/{trainer.last_saved}")
    return 0
