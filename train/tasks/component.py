"""A run task as one component: what ``shardzoo train --task NAME`` (or the model's own task)
does beyond the one program, in hooks that ``train/launch.py``, ``run_program`` and
``shardzoo eval`` call without asking which task it is. The defaults are those of a model
trained on its own task (``lm``, or a labelled model's classification or regression)."""

from __future__ import annotations

from shardzoo.errors import UserError
from shardzoo.train import model_info
from shardzoo.train.tasks.base import model_task
from shardzoo.train.tasks.settings import TASK_SETTINGS, TaskSettings
from shardzoo.train.trainer import Trainer


class RunTask:
    """The model's own task (``--task`` not given, or ``lm`` for a language model)."""

    name: str | None = None
    # what the data loader reads (``data.DataConfig``): prompt/chosen/rejected pairs, KTO's
    # unpaired rows with their mismatched pairs
    preference = False
    unpaired = False
    eval_task = "lm"  # ``shardzoo eval``'s default ``--task`` for a run of this task

    @property
    def settings(self) -> TaskSettings:
        """Its settings: the flags only it takes and their checks (``tasks/settings.py``)."""
        return TASK_SETTINGS[self.name]

    def model(self, cfg, config):
        """The model config this task trains, from the one the run names."""
        return config

    def task(self, cfg, config):
        """``(task, reference)`` of the Program (``Program.reference``: None without one)."""
        if self.name == "lm" and model_info.task(config) != "lm":
            raise UserError(f"--task lm: the model does {model_info.task(config)}, not language modelling")
        return model_task(config), None

    def teacher(self, cfg, config):
        """The config of a frozen second model whose outputs the task reads (distillation), or None."""
        return None

    def check(self, cfg) -> None:
        """Checks of the run's settings that need the file system, before anything is written."""

    def finish(self, cfg, program, strict: bool) -> None:
        """What the task adds to its built Program (GRPO's ``--reward-model``)."""

    def trainer(self, cfg):
        """The Trainer class that runs it."""
        return Trainer

    def datasets(self, cfg, data_config, tokenizer, mesh, rules, program):
        """``(train, eval or None)``: the run's batches (a language model's; labelled models'
        come from ``launch``'s own check of their columns)."""
        from shardzoo.data import make_datasets

        return make_datasets(data_config, tokenizer, cfg.seq_len, cfg.batch_size, mesh=mesh, rules=rules,
                             seed=cfg.seed)

    def frozen_params(self, cfg, program):
        """``target -> params`` of the frozen second model (``teacher``) placed on ``target``, or
        None (a reference model's params come from ``--reference`` or ``--init-from``)."""
        return None

    def default(self):
        """The task with its default settings (its metric names and signals, e.g. for ``plot``)."""
        raise UserError(f"--task {self.name} has no default task of its own")


def language_model_only(cfg, config) -> None:
    """A post-training task trains a language model: a one-line UserError otherwise."""
    if model_info.task(config) != "lm":
        raise UserError(f"--task {cfg.task} trains a language model; the model does {model_info.task(config)}")
