"""Each task names the metrics it learns from (``Task.signals``); the console line, the progress
bar, the final line and ``shardzoo plot`` show them beside the loss."""

import json
import struct

import pytest

from shardzoo.train.metrics import MetricsLogger, headline, plot_losses
from shardzoo.train.tasks.registry import get_task, run_signals

GRPO_RECORD = {"loss": -1.6e-07, "reward": 0.5, "reward_std": 0.1, "rewards/words/mean": 0.4,
               "rewards/words/std": 0.2, "rewards/length/mean": 0.3, "kl": 0.01, "tokens_per_sec": 100.0}
DPO_RECORD = {"loss": 0.69, "rewards/chosen": 0.1, "rewards/rejected": 0.0, "rewards/accuracies": 0.75,
              "rewards/margins": 0.1, "logps/chosen": -20.0}


@pytest.mark.parametrize("task, record, shown", [
    ("grpo", GRPO_RECORD, ["loss", "reward", "rewards/words/mean", "rewards/length/mean", "tokens_per_sec"]),
    ("dpo", DPO_RECORD, ["loss", "rewards/accuracies", "rewards/margins"]),
    ("classification", {"loss": 1.0, "accuracy": 0.5, "grad_norm": 1.0, "eval_accuracy_sampled": 0.4},
     ["loss", "accuracy", "eval_accuracy_sampled"]),
    ("lm", {"loss": 3.0, "accuracy": 0.1, "eval_loss": 3.1}, ["loss", "eval_loss"]),
])
def test_each_task_shows_its_learning_signal(task, record, shown):
    assert list(headline(record, get_task(task).signals)) == shown


def test_the_console_line_of_a_grpo_step_shows_the_reward(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), 10, 0, signals=get_task("grpo").signals)  # stderr is no terminal
    logger.log(3, {**GRPO_RECORD, "eval_reward_sampled": 0.45})
    logger.close()
    line = capsys.readouterr().out.strip()
    assert line == ("step 3: loss -1.6e-07, reward 0.5, rewards/words/mean 0.4, rewards/length/mean 0.3, "
                    "eval_reward_sampled 0.45, tokens_per_sec 100"), line


def _png_height(path) -> int:
    with open(path, "rb") as f:
        return struct.unpack(">I", f.read(24)[20:24])[0]


def test_plot_draws_a_panel_per_signal_of_the_runs_task(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in (1, 2, 3):
            f.write(json.dumps({"step": step, **GRPO_RECORD, "reward": 0.1 * step}) + "\n")
    signals = run_signals({"settings": {"task": {"task": "grpo"}}})
    assert signals == get_task("grpo").signals
    assert run_signals({"config": {"task": "classification"}, "settings": {"task": {"task": None}}}) == ("accuracy",)
    alone = _png_height(plot_losses(str(tmp_path), str(tmp_path / "loss.png")))
    panels = _png_height(plot_losses(str(tmp_path), str(tmp_path / "signals.png"), signals))
    assert panels > alone * 2  # three panels below the loss: reward and each function's mean


def test_sampled_and_whole_split_eval_accuracy_are_told_apart(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    drawn, plot = {}, Axes.plot

    def recording(self, *args, **kwargs):
        lines = plot(self, *args, **kwargs)
        drawn[kwargs.get("label")] = (lines[0].get_color(), lines[0].get_marker())
        return lines

    monkeypatch.setattr(Axes, "plot", recording)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in (1, 2):
            f.write(json.dumps({"step": step, "loss": 1.0, "eval_loss_sampled": 1.1, "eval_accuracy_sampled": 0.5}) + "\n")
        f.write(json.dumps({"step": 2, "eval_loss": 1.2, "eval_accuracy": 0.6}) + "\n")
    plot_losses(str(tmp_path), str(tmp_path / "loss.png"))
    sampled, whole = drawn["eval accuracy (sampled)"], drawn["eval accuracy (whole split)"]
    assert sampled[0] != whole[0] and sampled[1] != whole[1], drawn
