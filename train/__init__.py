"""shardzoo.train: the one program (train state, shardings, steps), tasks and the Trainer.

Heavy pieces (the Trainer, checkpoints, launch) are imported from their modules; the names here
are the ones a script needs to build and run the program.
"""

from shardzoo.train.config import TrainConfig
from shardzoo.train.optim import make_optimizer
from shardzoo.train.program import Program, TrainState, plan
from shardzoo.train.tasks.base import TASKS, Task
from shardzoo.train.tasks.registry import get_task, run_program

__all__ = ["TASKS", "Program", "Task", "TrainConfig", "TrainState", "get_task", "make_optimizer",
           "plan", "run_program"]
