"""Run metrics: OUT/metrics.jsonl, a tqdm progress bar, TensorBoard events, the loss plot."""

from __future__ import annotations

import datetime
import fnmatch
import json
import math
import os
import secrets
import sys

from shardzoo.errors import UserError

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class PlotError(UserError):
    """``shardzoo plot`` was pointed at a directory without metrics."""


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl (a torn last line, e.g. after a kill, is skipped)."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def truncate_metrics(path: str, last_step: int) -> None:
    """Drop the records after ``last_step`` (a resumed run writes them again)."""
    if not os.path.exists(path):
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)


def signal_keys(patterns, keys) -> list[str]:
    """The metric names among ``keys`` that match a task's signal ``patterns`` (``Task.signals``),
    in the order of the patterns."""
    found = []
    for pattern in patterns:
        found += [k for k in keys if fnmatch.fnmatchcase(k, pattern) and k not in found]
    return found


def headline(record: dict, signals=()) -> dict:
    """The figures a log line shows of ``record``: the loss, the task's learning signals (train
    and eval), eval loss and accuracy, and throughput."""
    names = ["loss", *signal_keys(signals, record), "eval_loss", "eval_loss_sampled", "eval_accuracy",
             "eval_accuracy_sampled",
             *signal_keys([f"eval_{p}{s}" for p in signals for s in ("", "_sampled")], record),
             "tokens_per_sec", "examples_per_sec"]
    return {k: record[k] for k in dict.fromkeys(names) if k in record}


def set_aside_orphans(out_dir: str) -> str | None:
    """A fresh start in a run dir whose ``metrics.jsonl`` holds rows but which has no checkpoint
    (its first save failed, it was killed before it, or its checkpoints were deleted): those rows
    belong to no checkpoint, so the file is moved to ``metrics.jsonl.orphaned-<time>`` (kept,
    never deleted) and the run starts. Returns the line that says so, or None."""
    path = os.path.join(out_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return None
    steps = [r["step"] for r in read_metrics(path) if isinstance(r.get("step"), int)]
    if not steps:
        return None
    dest = f"{path}.orphaned-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    k = 1
    while os.path.lexists(dest):
        dest, k = f"{path}.orphaned-{datetime.datetime.now():%Y%m%d-%H%M%S}-{k}", k + 1
    os.replace(path, dest)
    return (f"{path} held steps up to {max(steps)} but no checkpoint they belong to: moved it to {dest}; "
            "training from step 0")


def _number(value):
    value = float(value)
    return value if math.isfinite(value) else str(value)  # NaN/Inf as strings: strict JSON


def progress(total: int | None, desc: str, active: bool = True):
    """A tqdm bar with an ETA on stderr, cleared when done; off when stderr is not a terminal
    (a log or a pipe gets no bar) and where ``active`` is False (every process but 0)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="batch", file=sys.stderr, leave=False,
                disable=None if active else True)


class MetricsLogger:
    """Writes one JSON object per logged step, mirrors it to TensorBoard, drives the progress bar.

    Inactive (writes nothing) on every process but process 0.
    """

    def __init__(self, out_dir: str, total_steps: int, start_step: int, tensorboard: bool = False,
                 active: bool = True, wandb_project: str | None = None, settings: dict | None = None,
                 signals: tuple[str, ...] = ()):
        self.active, self.signals = active, tuple(signals)
        self.path = os.path.join(out_dir, METRICS_FILE)
        self.file = self.bar = self.tb = self.wandb = None
        if not active:
            return
        truncate_metrics(self.path, start_step)
        self.file = open(self.path, "a")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
        if wandb_project:
            self.wandb = start_wandb(out_dir, wandb_project, settings or {})
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                        dynamic_ncols=True, disable=None, file=sys.stderr)

    def log(self, step: int, values: dict) -> None:
        """Append ``{"step": step, **values}`` (numbers only) and show the headline figures."""
        if not self.active:
            return
        record = {"step": int(step)}
        for k, v in values.items():
            record[k] = v if isinstance(v, str) else _number(v)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, float):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step" and isinstance(v, float)}, step=int(step))
        shown = headline(record, self.signals)
        if self.bar.disable:
            print(f"step {step}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in shown.items()), flush=True)
        else:
            self.bar.set_postfix({k: _fmt(v) for k, v in shown.items()}, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.file is not None:
            self.file.close()
        self.file = self.bar = self.tb = self.wandb = None


WANDB_ID_FILE = "wandb-run-id"


def start_wandb(out_dir: str, project: str, settings: dict):
    """A Weights & Biases run for ``out_dir`` in ``project``: the same W&B run on every resume
    (its id kept in ``OUT/wandb-run-id``), its files under ``OUT/wandb``, the run's settings as
    its config. ``WANDB_MODE=offline`` writes only there; ``WANDB_API_KEY`` logs in."""
    import wandb

    id_path = os.path.join(out_dir, WANDB_ID_FILE)
    if os.path.isfile(id_path):
        with open(id_path) as f:
            run_id = f.read().strip()
    else:
        run_id = secrets.token_hex(6)  # W&B run ids: lowercase letters and digits
        with open(id_path, "w") as f:
            f.write(run_id + "\n")
    try:
        run = wandb.init(project=project, id=run_id, resume="allow", name=os.path.basename(out_dir),
                         dir=out_dir, config=settings, settings=wandb.Settings(silent=True))
    except Exception as e:  # noqa: BLE001 - login, network or project: one line, the run not started
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"--wandb {project}: cannot start a W&B run: {reason} (WANDB_MODE=offline logs "
                        "without an account)") from None
    print(f"wandb: logging to project {project}, run {run_id} ({run.settings.mode})", flush=True)
    return run


def _fmt(v) -> str:
    return v if isinstance(v, str) else f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"


PLOT_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp")


def _check_plot_target(out_path: str) -> None:
    """``--output`` names a file of a format matplotlib writes (never a directory, never a
    name matplotlib would silently extend with .png)."""
    if os.path.isdir(out_path):
        raise PlotError(f"--output {out_path} is a directory: give a file such as {os.path.join(out_path, PLOT_FILE)}")
    ext = os.path.splitext(out_path)[1].lower().lstrip(".")
    if ext not in PLOT_FORMATS:
        what = f"its extension .{ext} is not an image format" if ext else "it has no extension"
        raise PlotError(f"--output {out_path}: {what}; end it with one of "
                        f"{', '.join('.' + f for f in PLOT_FORMATS)}")


def _series(records, key):
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return tuple(zip(*points, strict=True)) if points else None


def plot_losses(run_dir: str, out_path: str | None = None, signals: tuple[str, ...] = ()) -> str:
    """Draw train and eval loss against step from ``RUN/metrics.jsonl`` to a PNG, and below it
    one panel per learning signal of the task (``signals``: ``Task.signals`` patterns, e.g.
    GRPO's reward and each reward function's mean), train and eval; return the file's path."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise PlotError(f"{path}: no such file (is {run_dir} a shardzoo run directory?)")
    out_path = out_path or os.path.join(run_dir, PLOT_FILE)
    _check_plot_target(out_path)
    records = read_metrics(path)
    curves = {}
    for key, label in (("loss", "train"), ("eval_loss_sampled", "eval (sampled, --eval-steps)"),
                       ("eval_loss", "eval (whole split)")):
        if _series(records, key):
            curves[label] = _series(records, key)
    if not curves:
        raise PlotError(f"{path}: no loss values to plot")
    keys = dict.fromkeys(k for r in records for k in r)
    panels = [k for k in signal_keys(signals, keys) if _series(records, k)]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1 + len(panels), 1, figsize=(7, 4.5 + 2.5 * len(panels)), sharex=True,
                             squeeze=False)
    axis = axes[0][0]
    for label, (steps, losses) in curves.items():
        axis.plot(steps, losses, marker="o" if label.startswith("eval") else None, markersize=4, label=label)
    axis.set_ylabel("loss")
    axis.set_title(os.path.basename(os.path.abspath(run_dir)))
    axis.grid(alpha=0.3)
    handles, labels = axis.get_legend_handles_labels()
    accuracy = {label: (_series(records, key), style) for key, label, style in (
        ("eval_accuracy_sampled", "eval accuracy (sampled)", dict(marker="^", color="tab:olive")),
        ("eval_accuracy", "eval accuracy (whole split)", dict(marker="s", color="tab:green")))}
    if any(points for points, _ in accuracy.values()):  # accuracy on its own axis, at the right
        right = axis.twinx()
        for label, (points, style) in accuracy.items():
            if points:
                right.plot(*points, linestyle="--", markersize=4, label=label, **style)
        right.set_ylabel("accuracy")
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    axis.legend(handles, labels)
    for (panel,), key in zip(axes[1:], panels, strict=True):
        panel.plot(*_series(records, key), label="train")
        for suffix, label, marker in (("_sampled", "eval (sampled)", "^"), ("", "eval (whole split)", "s")):
            if _series(records, f"eval_{key}{suffix}"):
                panel.plot(*_series(records, f"eval_{key}{suffix}"), marker=marker, markersize=4, label=label)
        panel.set_ylabel(key)
        panel.grid(alpha=0.3)
        panel.legend()
    axes[-1][0].set_xlabel("step")
    try:
        fig.savefig(out_path, dpi=100, bbox_inches="tight")
    except OSError as e:
        raise PlotError(f"cannot write the plot to {out_path}: {e.strerror}; choose another --output") from None
    finally:
        plt.close(fig)
    return out_path
