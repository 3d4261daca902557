"""The planning commands, ``plan`` and ``advise``: what a run would cost, without running it.

Part of the face (``cli.py`` registers them): each parses its flags, calls the library and prints.
"""

from __future__ import annotations

import argparse

from shardzoo.errors import UserError
from shardzoo.train.config import OPTIMIZERS
from shardzoo.train.tasks.settings import TASKS


# --------------------------------------------------------------------------- plan
def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="a registered model (see shardzoo.models.list_models())")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="change a config field, e.g. --override remat_policy=full (repeatable)")
    p.add_argument("--rules", default=None, metavar="NAME|FILE",
                   help="a preset (dp, fsdp, tp, fsdp_tp, sp, cp, cp_fsdp, ep) or a YAML/JSON rule file "
                        "(default: as train's, fsdp on a mesh of more than one device, dp on one)")
    p.add_argument("--mesh", required=True, metavar="SPEC",
                   help="e.g. fsdp=32,tensor=8; a spec without -1 that does not match the local "
                        "device count is planned on an abstract mesh (no devices needed)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: mesh size)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="sequence length of an LM (default: min(2048, max_position_embeddings))")
    p.add_argument("--device-memory", default=None, metavar="SIZE|DEVICE",
                   help="e.g. 80GB, 16GiB, or h100, h200, a100, v5p, v5e, v4: "
                        "adds a fits/does-not-fit verdict")
    p.add_argument("--compile", action="store_true",
                   help="also compile the train step ahead of time on the local devices (their "
                        "count must equal the mesh's) and report XLA's memory and collectives")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                   help="the run's optimizer: its state is planned and compiled (default: adamw)")
    p.add_argument("--opt-rules", default=None, metavar="NAME|FILE",
                   help="a separate rule table for the optimizer state, e.g. zero1")
    p.add_argument("--grad-accum", type=int, default=1, help="microbatches per step (default: 1)")
    p.add_argument("--task", default=None, choices=TASKS[1:],
                   help="dpo: preference pairs (--batch-size counts pairs) and the reference model's bytes; "
                        "reward: preference pairs through a score-head model (no reference); "
                        "kto: as dpo, a row and its mismatched KL row for each example; "
                        "grpo, rloo: sampled completions (--batch-size counts them), the reference model's bytes "
                        "(with --beta > 0) and the rollouts' decoding cache; "
                        "distill: the --teacher's bytes and its logits in the batch")
    p.add_argument("--teacher", default=None, metavar="MODEL|DIR",
                   help="--task distill: the teacher, a zoo model name or a run/HF dir (its vocabulary the model's)")
    p.add_argument("--lmbda", type=float, default=0.0,
                   help="--task distill: on-policy GKD's share of student-sampled steps (> 0: the sampler's cache)")
    p.add_argument("--seq-kd", action="store_true", help="--task distill: the teacher samples the other steps")
    p.add_argument("--reward-model", default=None, metavar="MODEL|DIR",
                   help="--task grpo/rloo: a reward model (a zoo model name with a score head, or a run/HF dir): "
                        "its bytes, sharded by the same rules")
    p.add_argument("--loss", default=None, help="--task dpo: sigmoid (default) or any of TRL's loss_type (a reference "
                                                "unless simpo or orpo); "
                                                "--task grpo: dapo (default), grpo, bnpo, dr_grpo, cispo, sapo, "
                                                "luspo or vespo")
    p.add_argument("--beta", type=float, default=None,
                   help="--task grpo: the KL coefficient (default 0: no reference model); --task rloo: the KL "
                        "penalty in the reward (default 0.05); --task dpo: its beta")
    p.add_argument("--num-generations", type=int, default=None,
                   help="--task grpo: completions per prompt (default: TrainConfig's)")
    p.add_argument("--precompute-reference", action="store_true",
                   help="--task dpo: reference log-probs stored with the run (no reference model)")
    p.add_argument("--json", action="store_true", help="print JSON for tools instead of a table")
    p.add_argument("--non-strict", action="store_true",
                   help="report validation problems as warnings instead of failing")


def _format_compiled(result: dict, plan) -> str:
    from shardzoo.sharding.plan import format_bytes

    m, t = result["memory"], plan.totals
    state = t["params"] + t["optimizer"]
    lines = ["compiled train step (XLA memory_analysis, per device): the step `shardzoo train` runs"]
    if m:
        lines += [
            f"  arguments  {format_bytes(m['argument'])}  (plan: params + optimizer state "
            f"{format_bytes(state)} + batch {format_bytes(result['batch_bytes'])})",
            f"  outputs    {format_bytes(m['output'])}"
            f"  (aliased to donated arguments: {format_bytes(m['alias'])})",
            f"  temp       {format_bytes(m['temp'])}",
            f"  total      {format_bytes(m['total'])}  (arguments + outputs + temp - aliased;"
            f" plan estimate {format_bytes(t['total'])})",
        ]
    else:
        lines.append("  (this backend gives no memory analysis)")
    lines.append("collectives: " + ", ".join(f"{op} {n}" for op, n in result["collectives"].items()))
    return "\n".join(lines)


def cmd_plan(args) -> int:
    """Print the sharding plan of a model's training run: a table, or JSON with --json."""
    import json
    import math
    import warnings

    from shardzoo.models import get_model, parse_overrides
    from shardzoo.sharding.mesh import mesh_shape
    from shardzoo.sharding.plan import local_device_memory, planning_mesh
    from shardzoo.sharding.rules import get_rules
    from shardzoo.sharding.validate import ShardingValidationError, ShardingValidationWarning
    from shardzoo.train.config import TrainConfig
    from shardzoo.train.defaults import default_rules, default_seq_len, pad_vocab
    from shardzoo.train.tasks.registry import run_program

    module, config = get_model(args.model, **parse_overrides(args.override))
    opt_rules = get_rules(args.opt_rules) if args.opt_rules else None
    if not args.mesh.strip():
        raise UserError("--mesh '' names no mesh axis: give one such as fsdp=8 or data=2,tensor=4")
    mesh = planning_mesh(args.mesh)
    devices = math.prod(mesh_shape(mesh).values())
    rules = get_rules(args.rules or default_rules(devices))
    config, vocab_note = pad_vocab(config, rules, mesh)
    batch = args.batch_size if args.batch_size is not None else devices
    seq_len = args.seq_len if args.seq_len is not None else default_seq_len(config)
    positions = getattr(config, "max_positions", None)
    if positions is not None and seq_len > positions:
        raise UserError(f"--seq-len {seq_len} exceeds the model's {positions} positions "
                        f"(max_position_embeddings): use --seq-len {positions} or less")
    settings = TrainConfig(batch_size=batch, seq_len=seq_len, optimizer=args.optimizer,
                           grad_accum=args.grad_accum, task=args.task, loss=args.loss, beta=args.beta,
                           precompute_reference=args.precompute_reference, override=list(args.override),
                           teacher=args.teacher, reward_model=args.reward_model, lmbda=args.lmbda, seq_kd=args.seq_kd,
                           **({"num_generations": args.num_generations} if args.num_generations else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingValidationWarning)  # the plan lists them
        try:
            program = run_program(settings, config, rules, mesh, opt_rules=opt_rules,
                                  strict=not args.non_strict)
        except ShardingValidationError as e:
            raise UserError(e.summary(hint="--non-strict makes these warnings")) from None
        memory = args.device_memory if args.device_memory is not None else local_device_memory()
        result = program.plan(device_memory=memory, name=args.model)
        if args.compile and program.is_abstract:
            import jax

            raise UserError(
                f"--compile needs the mesh's {devices} devices locally, this machine has "
                f"{jax.device_count()} (fake CPU devices: "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={devices})"
            )
        compiled = program.compile_report() if args.compile else None
    if args.json:
        out = result.to_dict()
        out["batch_size"], out["seq_len"] = batch, seq_len
        out["compile"] = compiled
        print(json.dumps(out, indent=2))
    else:
        if vocab_note:
            print(vocab_note)
        print(result.format())
        if compiled:
            print()
            print(_format_compiled(compiled, result))
    return 0


# --------------------------------------------------------------------------- advise
def add_advise_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a registered model")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="change a config field (repeatable); remat_policy=... keeps that one policy")
    p.add_argument("--devices", type=int, required=True, help="how many devices to plan for")
    p.add_argument("--device-memory", required=True, metavar="KIND|SIZE",
                   help="h100, h200, a100, v5p, v5e, v4, or a size like 80GB (h100's compute and links)")
    p.add_argument("--devices-per-host", type=int, default=None,
                   help="devices sharing the fast link (default: the kind's, 8 for GPUs)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: --devices)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="sequence length of an LM (default: min(2048, max_position_embeddings))")
    p.add_argument("--candidates", default=None, metavar="NAME,...|FILE,...",
                   help="rule tables to try: presets and YAML/JSON rule files, comma-separated "
                        "(default: every parameter preset)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="memory kept free for XLA's buffers, a fraction (default: 0.1)")
    p.add_argument("--top", type=int, default=5, help="how many candidates to show (default: 5)")
    p.add_argument("--verify", action="store_true",
                   help="compile the top candidates' train step on this machine's devices (fake CPU "
                        "devices: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    p.add_argument("--json", action="store_true", help="print JSON for tools instead of a table")


def cmd_advise(args) -> int:
    """Rank rule tables and mesh shapes for a model on a topology (no devices needed)."""
    from shardzoo.models import get_model, parse_overrides
    from shardzoo.train import advise

    overrides = parse_overrides(args.override)
    _, config = get_model(args.model, **overrides)
    if args.top < 1:
        raise UserError(f"--top {args.top}: must be at least 1")
    candidates = [c.strip() for c in args.candidates.split(",") if c.strip()] if args.candidates else None
    result = advise.advise_model(
        config, name=args.model, num_devices=args.devices, device_memory=args.device_memory,
        devices_per_host=args.devices_per_host, batch_size=args.batch_size, seq_len=args.seq_len,
        candidates=candidates, headroom=args.headroom, pinned_remat="remat_policy" in overrides)
    if args.verify:
        advise.verify(result, config, args.top)
    if args.json:
        print(result.to_json(args.top))
    else:
        print(result.format(args.top))
        if args.verify:
            print()
            print(advise.format_verify(result.verify))
    return 0
