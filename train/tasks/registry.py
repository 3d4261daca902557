"""The task registry: each ``shardzoo train --task`` as one component (``tasks/component.py``),
and the Program of a run's settings. ``launch``, ``plan``, ``shardzoo eval`` and ``plot`` ask
the run's component; none of them names a task. A component's settings (the flags only it takes
and their checks) are its entry of ``tasks/settings.py``'s ``TASK_SETTINGS`` (``component.settings``),
which ``TrainConfig`` reads without importing the tasks' code."""

from __future__ import annotations

from shardzoo.errors import UserError
from shardzoo.train.program import Program, settings_program
from shardzoo.train.tasks.base import TASKS as MODEL_TASKS
from shardzoo.train.tasks.base import Task
from shardzoo.train.tasks.component import RunTask
from shardzoo.train.tasks.distill import DistillRun
from shardzoo.train.tasks.kto import KTORun
from shardzoo.train.tasks.preference import DPORun
from shardzoo.train.tasks.reward import RewardRun
from shardzoo.train.tasks.rollouts import RolloutRun
from shardzoo.train.tasks.settings import TASKS as TASK_NAMES


class LMRun(RunTask):
    """``--task lm``: next-token prediction (a language model's own task, said out loud)."""

    name = "lm"


RUN_TASKS: dict[str | None, RunTask] = {c.name: c for c in (
    RunTask(), LMRun(), DPORun(), KTORun(), RolloutRun("grpo"), RolloutRun("rloo"), RewardRun(), DistillRun())}
assert tuple(RUN_TASKS) == TASK_NAMES, "tasks/settings.py names the --task choices: one component each"


def run_task(cfg) -> RunTask:
    """The component of a run's ``--task`` (``cfg``: a TrainConfig; None: the model's own)."""
    name = getattr(cfg, "task", None)
    if name not in RUN_TASKS:
        raise UserError(f"--task {name!r}: choose one of {', '.join(n for n in RUN_TASKS if n)}")
    return RUN_TASKS[name]


def get_task(name: str) -> Task:
    """A task by name with its default settings: a model's own (``lm``, ``classification``,
    ``regression``) or a run task's (``dpo``, ``grpo``, ...)."""
    if name in MODEL_TASKS:
        return MODEL_TASKS[name]
    if name not in RUN_TASKS or name is None:
        raise UserError(f"task {name!r} is not one of {', '.join([*MODEL_TASKS, *(n for n in RUN_TASKS if n)])}")
    return RUN_TASKS[name].default()


def run_signals(run: dict | None) -> tuple[str, ...]:
    """The signal patterns (``Task.signals``) of the task a run's ``run.json`` trained."""
    settings = (run or {}).get("settings") or {}
    name = (settings.get("task") or {}).get("task") or ((run or {}).get("config") or {}).get("task") or "lm"
    try:
        return get_task(name).signals
    except UserError:
        return ()


def run_program(cfg, config, rules, mesh, *, opt_rules=None, strict=True) -> Program:
    """The Program of a training run's settings (``cfg``: a TrainConfig): the one that
    ``shardzoo train`` steps and ``shardzoo plan --compile`` compiles."""
    component = run_task(cfg)
    config = component.model(cfg, config)
    task, reference = component.task(cfg, config)
    program = settings_program(cfg, config, rules, mesh, opt_rules=opt_rules, strict=strict, task=task,
                               reference=reference, teacher=component.teacher(cfg, config))
    component.finish(cfg, program, strict)
    return program
