"""The train step fitted to the device's memory before a run writes anything.

With the device's memory known (``--device-memory``, else the accelerator's own limit), the
run's step is compiled through its Program and XLA's ``memory_analysis`` (arguments + outputs +
temporaries - aliased, plus a frozen reference model's params) is held against it
(``sharding.plan.first_fit``, a small headroom kept free). ``--remat auto`` compiles the
model's policies fastest first (``models.execution.AUTO_REMAT``) and keeps the first that fits;
a named policy is only checked. The Program of the choice (its step compiled) is the one the
Trainer runs: nothing compiles twice. A step that fits nothing is ``StepDoesNotFit``: one line
naming the bytes needed and available and what would make it fit. A resumed ``auto`` run keeps
the policy its checkpoint records, so it compiles the step it saved.
"""

from __future__ import annotations

import dataclasses
import math
import re

from shardzoo.errors import UserError
from shardzoo.models.execution import AUTO_REMAT
from shardzoo.sharding.plan import first_fit, format_bytes, local_device_memory, parse_device_memory
from shardzoo.train.config import ConfigError
from shardzoo.train.jit import memory_analysis

AUTO = "auto"
# XLA's sizes in its out-of-memory messages ("37.32G exceeds available HBM (15.75G)"), binary units
_XLA_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_EXCEEDS = re.compile(r"([0-9.]+)([KMGT]?)i?B?\s+exceeds\s+[^(]*\(([0-9.]+)([KMGT]?)i?B?\)")


class StepDoesNotFit(UserError):
    """The train step needs more memory than one device has."""


@dataclasses.dataclass(frozen=True)
class Fitted:
    """The run's step as it will run: ``program`` (its step compiled when a fit was checked),
    its model ``config`` and the concrete ``remat`` policy (None: the model has none), and the
    ``line`` that says what was chosen (None: nothing to say)."""

    program: object
    config: object
    remat: str | None
    line: str | None = None


def device_memory(cfg) -> tuple[str, int] | None:
    """(label, bytes) one device may use: ``--device-memory``, else the accelerator's own
    limit; None on CPU without the flag."""
    if cfg.device_memory:
        return f"--device-memory {cfg.device_memory}", parse_device_memory(cfg.device_memory)[1]
    return local_device_memory()


def requested_remat(cfg, config, accelerator: bool) -> str | None:
    """The policy the run asks for: ``--remat``, else a ``--override remat_policy=``, else
    ``auto`` on an accelerator and the model's own on CPU; None for a model without policies."""
    policies = tuple(config.remat_policies)
    overridden = next((o.split("=", 1)[1].strip() for o in reversed(cfg.override)
                       if o.split("=", 1)[0].strip() == "remat_policy"), None)
    if cfg.remat is not None:
        if not policies:
            raise ConfigError(f"--remat {cfg.remat}: --model {cfg.model} has no remat policies")
        if cfg.remat != AUTO and cfg.remat not in policies:
            raise ConfigError(f"--remat {cfg.remat!r}: choose auto or one of {', '.join(policies)}")
        if overridden is not None and overridden != cfg.remat:
            raise ConfigError(f"--remat {cfg.remat} and --override remat_policy={overridden} disagree: give one")
        return cfg.remat
    if not policies:
        return None
    if overridden is not None:
        return config.execution.remat_policy
    return AUTO if accelerator else config.execution.remat_policy


def step_bytes(program) -> float | None:
    """Bytes one device needs to run ``program``'s train step (compiling it): XLA's
    ``memory_analysis`` total plus a frozen reference (and reward) model's params; when the compile itself
    runs out of memory, the size XLA names (inf if it names none). None: the backend does not say."""
    try:
        compiled = program.compiled_train_step()
    except Exception as e:  # noqa: BLE001 - only running out of memory is a verdict; the rest re-raises
        if not is_out_of_memory(e):
            raise
        needed, _ = xla_sizes(str(e))
        return needed if needed is not None else math.inf
    total = memory_analysis(compiled).get("total")
    return None if total is None else total + (program.reference_bytes() or 0) + (program.reward_model_bytes() or 0)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is XLA running out of device memory (RESOURCE_EXHAUSTED)."""
    import jax

    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def xla_sizes(message: str) -> tuple[float | None, float | None]:
    """(needed, available) bytes from an XLA out-of-memory message, None where it names none."""
    m = _EXCEEDS.search(message)
    if not m:
        return None, None
    return float(m.group(1)) * _XLA_UNITS[m.group(2)], float(m.group(3)) * _XLA_UNITS[m.group(4)]


def fit_step(cfg, config, build, memory, policy: str | None, *, recorded: str | None = None) -> Fitted:
    """The run's program fitted to ``memory`` ((label, bytes) or None: nothing to check).

    ``build(config) -> Program``; ``policy``: ``requested_remat``'s answer; ``recorded``: the
    policy of the checkpoint an ``auto`` run resumes (kept as it is). Raises StepDoesNotFit."""
    line = None
    if policy == AUTO and recorded is not None:
        policy, line = recorded, f"remat auto: {recorded}, as the checkpoint it resumes records"
    elif policy == AUTO and memory is None:
        policy = next(p for p in AUTO_REMAT if p in config.remat_policies)
        line = f"remat auto: {policy}, the fastest (no device memory known: --device-memory names one)"
    elif policy == AUTO:
        candidates = [p for p in AUTO_REMAT if p in config.remat_policies]
        programs = {}

        def needed(p):
            programs.clear()  # a rejected candidate's compiled step is let go
            programs[p] = build(config.replace(remat_policy=p))
            return step_bytes(programs[p])

        fit = first_fit(candidates, needed, memory[1])
        if fit.choice is None:
            raise StepDoesNotFit(_does_not_fit(cfg, config, fit, memory[0]))
        tried = ", ".join(f"{p} {_size(n)}" for p, n in fit.needed)
        line = (f"remat auto: {fit.choice}, the first of {', '.join(candidates)} (fastest first) whose train "
                f"step fits one device ({tried}; it may use {format_bytes(fit.budget)} of {memory[0]})")
        return Fitted(programs[fit.choice], config.replace(remat_policy=fit.choice), fit.choice, line)
    if policy is not None and policy != config.execution.remat_policy:
        config = config.replace(remat_policy=policy)
    program = build(config)
    if memory is not None:
        fit = first_fit([policy or "-"], lambda _: step_bytes(program), memory[1])
        if fit.choice is None:
            raise StepDoesNotFit(_does_not_fit(cfg, config, fit, memory[0]))
    return Fitted(program, config, policy, line)


def _size(n) -> str:
    return "?" if n is None else "out of memory" if n == math.inf else format_bytes(n)


def out_of_memory_message(cfg, config, memory, error) -> str:
    """The one line for a step that ran out of device memory while running (``error``, XLA's)."""
    needed, available = xla_sizes(str(error))
    limit = memory[1] if memory is not None else available
    policy = getattr(getattr(config, "execution", None), "remat_policy", None)
    step = f"the train step (remat {policy})" if policy else "the train step"
    what = f"needs {format_bytes(needed)} per device" if needed is not None else "ran out of device memory"
    has = "" if limit is None else f", one device has {format_bytes(limit)}"
    has += f" ({memory[0]})" if memory is not None else ""
    return f"{step} {what} while running{has}: {_remedies(cfg, config, tried_full=False)}"


def _does_not_fit(cfg, config, fit, label: str) -> str:
    least = min((n for _, n in fit.needed if n is not None), default=math.inf)
    tried = ", ".join(f"remat {p} {_size(n)}" if p != "-" else _size(n) for p, n in fit.needed)
    need = "more than it" if least == math.inf else format_bytes(least)
    return (f"the train step does not fit one device: it needs {need} ({tried}), one device has "
            f"{format_bytes(fit.limit)} ({label}; a step may use {format_bytes(fit.budget)}): "
            + _remedies(cfg, config, tried_full=any(p == "full" for p, _ in fit.needed)))


def _remedies(cfg, config, tried_full: bool) -> str:
    """What would make a step fit, leaving out what the run already does."""
    execution = getattr(config, "execution", None)
    ways = [f"a smaller --batch-size (now {cfg.batch_size}) or --seq-len (now {cfg.seq_len})"]
    if config.remat_policies and not tried_full and getattr(execution, "remat_policy", None) != "full":
        ways.append("--remat full")
    if getattr(execution, "param_dtype", None) == "float32":
        ways.append("--override param_dtype=bfloat16 (params and optimizer state in half the bytes)")
    ways.append("the optimizer state sharded (--opt-rules zero1, or --rules fsdp over more devices)")
    ways.append(f"--grad-accum {2 * cfg.grad_accum} (the batch in smaller microbatches)")
    return "try " + ", ".join(ways[:-1]) + " or " + ways[-1]
