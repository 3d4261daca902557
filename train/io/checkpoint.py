"""Checkpoints with orbax: layout, saves, damaged steps, and restores onto any mesh.

Layout of a run directory ``OUT``::

    OUT/run.json                 resolved settings of the latest start (model, overrides, ...)
    OUT/tokenizer/               the tokenizer's files, when it has any
    OUT/checkpoints/<step>/      orbax Composite: state (TrainState arrays, StandardSave),
                                 data (iterator position + RNG, JSON), meta (model preset,
                                 family, whole config, rules, mesh, tokenizer, optimizer; JSON)

Half-written steps live in ``<step>.orbax-checkpoint-tmp-*`` and are never picked up.
Restores build ``jax.ShapeDtypeStruct`` targets carrying the *new* shardings, so a checkpoint
written under one mesh and rule table loads onto any other. What a step's ``meta`` holds is
``runmeta.py``'s; opening a path (a run, a step, an HF dir) is ``sources.py``'s.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import sys

import jax
import orbax.checkpoint as ocp

from shardzoo.errors import EnvironmentFault, UserError

CHECKPOINTS = "checkpoints"
DAMAGED = "damaged-checkpoints"  # where a step that cannot be restored is moved, never deleted
FORMAT = 1
# Files every finished step holds (a step without one of them cannot be restored).
STEP_FILES = ("_CHECKPOINT_METADATA", "state/_METADATA", "data/metadata", "meta/metadata")
# Marks of a failed read (a truncated or missing file) in orbax's and tensorstore's errors.
_READ_ERRORS = ("OUT_OF_RANGE", "DATA_LOSS", "NOT_FOUND", "Error reading", "No such file",
                "FileNotFoundError", "Unexpected end", "checksum")


class CheckpointError(UserError):
    """A checkpoint or run directory the user named is missing, unreadable or does not match."""


class DamagedCheckpoint(CheckpointError):
    """Step ``step`` under ``root`` cannot be restored: a file of it is missing or truncated."""

    def __init__(self, root: str, step: int, problem: str):
        self.root, self.step, self.problem = root, step, problem
        super().__init__(f"{root}/{step} cannot be restored: {problem}")


def warn(text: str) -> None:
    """One warning line on stderr (process 0 only)."""
    if jax.process_index() == 0:
        print(f"shardzoo: warning: {text}", file=sys.stderr, flush=True)


def _error_text(e: BaseException) -> str:
    """The messages of ``e`` and of every exception it was raised from."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


def _first_line_with(text: str, marks) -> str | None:
    for line in text.splitlines():
        if any(m in line for m in marks):
            line = line.strip()
            return line if len(line) <= 300 else line[:297] + "..."
    return None


def damage(root: str, step: int) -> str | None:
    """What is structurally wrong with step ``step`` under ``root`` (None: nothing seen)."""
    where = os.path.join(root, str(step))
    for name in STEP_FILES:
        path = os.path.join(where, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) == 0:
            return f"{name} is empty"
        try:  # every one of them is JSON that orbax parses (a garbled one ended as a "mismatch")
            with open(path, "rb") as f:
                json.loads(f.read())
        except (OSError, ValueError) as e:
            return f"{name} is not readable JSON ({e.strerror if isinstance(e, OSError) else 'garbled'})"
    return None


def verify(root: str, step: int) -> str | None:
    """``damage`` plus a read of every stored byte of the step's arrays (as costly as reading
    the checkpoint once, so a restore reads it twice): what is wrong, or None. Restores call it
    first because orbax, on a failed read, leaves its other reads in flight to end on a closed
    event loop, each printing a traceback."""
    problem = damage(root, step)
    state = os.path.join(root, str(step), "state")
    if problem:
        return problem
    if not os.path.isfile(os.path.join(state, "manifest.ocdbt")):
        with open(os.path.join(state, "_METADATA"), "rb") as f:  # damage() parsed it
            ocdbt = json.loads(f.read()).get("use_ocdbt", False)
        return "state/manifest.ocdbt is missing" if ocdbt else None  # orbax would find no array
    import tensorstore as ts

    try:
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state}/"}).result()
        reads = [kv.read(key) for key in kv.list().result()]
        for read in reads:
            read.result()
    except Exception as e:  # noqa: BLE001 - tensorstore's errors are ValueErrors with a status
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def _restore_failure(root: str, step: int, e: Exception, mismatch: str) -> CheckpointError:
    """A DamagedCheckpoint for a failed read, else a CheckpointError saying ``mismatch``."""
    text = _error_text(e)
    read = _first_line_with(text, _READ_ERRORS)
    if read is not None:
        return DamagedCheckpoint(root, step, read)
    return CheckpointError(f"{root}/{step}: {mismatch}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")


def jsonable(value):
    """A JSON-safe copy (tuples become lists, unknown objects their str)."""
    return json.loads(json.dumps(value, default=str))


def _manager(root: str, read_only: bool, keep: int | None = None) -> ocp.CheckpointManager:
    if not read_only:
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True)
        return ocp.CheckpointManager(root, options=options)
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns that a read-only manager will not save: not news
    try:
        return ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    finally:
        absl.setLevel(level)


def all_steps(root: str) -> list[int]:
    """The finished checkpoint steps under ``root``, newest first; creates nothing."""
    if not os.path.isdir(root):
        return []
    return sorted(_manager(root, read_only=True).all_steps(), reverse=True)


def latest_step(root: str) -> int | None:
    """The newest finished checkpoint step under ``root`` (None if none); creates nothing."""
    steps = all_steps(root)
    return steps[0] if steps else None


def read_meta(root: str, step: int) -> dict:
    problem = damage(root, step)
    if problem:
        raise DamagedCheckpoint(root, step, problem)
    try:
        restored = _manager(root, read_only=True).restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 - any failure here is an unreadable checkpoint
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DamagedCheckpoint(root, step, f"its meta cannot be read: {reason}") from None
    return restored.meta


def newest_restorable(root: str, steps: list[int], load):
    """``load(step)`` for the newest of ``steps`` whose checkpoint is not damaged, saying in one
    line for each newer step why it was passed over; raises a CheckpointError when none loads."""
    damaged = []
    for step in steps:
        try:
            result = load(step)
        except DamagedCheckpoint as e:
            damaged.append(e)
            continue
        for e in damaged:
            warn(f"checkpoint step {e.step} in {root} cannot be restored ({e.problem}); using step {step}")
        return step, result
    raise no_restorable(root, damaged)


def no_restorable(root: str, damaged) -> CheckpointError:
    if len(damaged) == 1:  # one step was tried (the only one, or the one named)
        return damaged[0]
    problems = "; ".join(f"step {e.step}: {e.problem}" for e in damaged)
    return CheckpointError(f"{root}: no checkpoint can be restored ({problems}); "
                           f"start a new --out or restore the files")


class _OrbaxErrors(logging.Filter):
    """Drops orbax's own error logs: a failed save is reported once, in one line, by Checkpointer."""

    def filter(self, record):
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


class _MetadataParseErrors(logging.Filter):
    """Drops orbax's ``Failed to json parse Metadata file`` errors, which it logs each time it
    lists the steps of a run with an empty or garbled step metadata file: ``damage`` names that
    file in the one line the readers print (``newest_restorable``, ``Checkpointer.set_aside``)."""

    def filter(self, record):
        return not ("orbax" in record.pathname and str(record.msg).startswith("Failed to json parse"))


logging.getLogger("absl").addFilter(_MetadataParseErrors())


class Checkpointer:
    """Writes and restores one run's checkpoints (async; keeps the newest ``keep``).

    A failed save raises ``EnvironmentFault`` (a full disk: exit 1) or ``CheckpointError`` (a
    read-only or forbidden directory: exit 2) with one line, at the latest by the next ``save``,
    ``check`` or ``close``; the checkpoints already written stay as they are.
    """

    def __init__(self, out_dir: str, keep: int):
        self.out_dir = out_dir
        self.root = os.path.join(out_dir, CHECKPOINTS)
        self.failed = False
        self.saving = None  # the step of the newest save started
        self._filter = _OrbaxErrors()
        logging.getLogger("absl").addFilter(self._filter)
        try:
            self.manager = _manager(self.root, read_only=False, keep=keep)
        except OSError as e:
            raise self._save_failed(None, e) from None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps(), reverse=True)

    def save(self, step: int, state, data: dict, meta: dict) -> None:
        """Start an async save of ``state`` (arrays), ``data`` and ``meta`` (JSON) at ``step``."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(jsonable(data)),
            meta=ocp.args.JsonSave(jsonable({**meta, "step": step, "format": FORMAT})),
        )
        self._check_space(step, state)
        try:
            self.manager.save(step, args=args, force=True)
        except Exception as e:  # noqa: BLE001 - this or an earlier async save failed
            raise self._save_failed(self.saving if self.manager.is_saving_in_progress() else step, e) from None
        self.saving = step

    def _check_space(self, step: int, state) -> None:
        """Refuse a save that cannot fit before orbax starts writing it: a full disk found in the
        middle of an async save leaves writes in flight that end noisily."""
        need = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state))
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return
        if free < need + 2**20:  # the arrays, plus room for metadata and the previous save's tail
            self.check()  # an earlier save still in flight ends first, kept
            try:
                self.manager.wait_until_finished()
            except Exception as e:  # noqa: BLE001
                raise self._save_failed(self.saving, e) from None
            raise EnvironmentFault(
                f"saving checkpoint step {step} to {self.root} needs about {need / 2**20:.1f} MiB, "
                f"its disk has {free / 2**20:.1f} MiB free (No space left on device); {self._kept()}; "
                f"free space and run the same command to resume")

    def check(self) -> None:
        """Raise now if an async save has failed in the background."""
        try:
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            raise self._save_failed(self.saving, e) from None

    def _save_failed(self, step, e: Exception):
        self.failed = True
        text = _error_text(e)
        match = re.search(r"os_error_code='?(\d+)", text)
        code = int(match.group(1)) if match else getattr(e, "errno", None)
        reason = os.strerror(code) if code else (str(e).splitlines()[0] if str(e) else type(e).__name__)
        what = f"saving checkpoint step {step}" if step is not None else "saving a checkpoint"
        kept = self._kept()
        if code in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR):
            return CheckpointError(f"{what} to {self.root} failed: {reason}; make it writable or "
                                   f"choose another --out ({kept})")
        return EnvironmentFault(f"{what} to {self.root} failed: {reason}; {kept}; fix that and run "
                                f"the same command to resume")

    def _kept(self) -> str:
        try:
            steps = sorted(int(n) for n in os.listdir(self.root) if n.isdigit())
        except OSError:
            steps = []
        if not steps:
            return "no checkpoint was written before"
        return f"the checkpoints written before (steps {', '.join(map(str, steps))}) are intact"

    def restore(self, step: int, target) -> tuple:
        """``(state, data)``; ``target`` is a tree of ShapeDtypeStructs with the new shardings."""
        problem = verify(self.root, step)  # before orbax: a failed read there ends noisily
        if problem:
            raise DamagedCheckpoint(self.root, step, problem)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
        try:
            restored = self.manager.restore(step, args=args)
        except Exception as e:  # noqa: BLE001 - damaged files, or another model's state
            raise _restore_failure(self.root, step, e, "the saved train state does not match this "
                                   "run's (model or optimizer changed?)") from None
        return restored.state, restored.data

    def restore_newest(self, start) -> int | None:
        """``start(step)`` for the newest restorable step (``start(None)`` when there is none yet).

        Newer steps that cannot be restored are moved to ``OUT/damaged-checkpoints`` (never
        deleted), each with one line; when no step restores, nothing is moved and a
        CheckpointError names the directory.
        """
        steps = self.steps()
        if not steps:
            start(None)
            return None
        damaged = []
        for step in steps:
            try:
                start(step)
            except DamagedCheckpoint as e:
                damaged.append(e)
                continue
            for e in damaged:
                self.set_aside(e, step)
            return step
        raise no_restorable(self.root, damaged)

    def set_aside(self, e: DamagedCheckpoint, using: int) -> str:
        """Move the damaged step out of the checkpoints dir, saying so in one line."""
        parent = os.path.join(self.out_dir, DAMAGED)
        dest, k = os.path.join(parent, str(e.step)), 1
        while os.path.lexists(dest):
            dest, k = os.path.join(parent, f"{e.step}-{k}"), k + 1
        if jax.process_index() == 0:
            os.makedirs(parent, exist_ok=True)
            shutil.move(os.path.join(self.root, str(e.step)), dest)
        warn(f"checkpoint step {e.step} cannot be restored ({e.problem}); moved it to {dest} and "
             f"resuming from step {using}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("shardzoo set_aside")
        self.manager.reload()
        return dest

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the last save and close. After a failed save, leave orbax's threads alone:
        the command is about to end with that error (``python -m shardzoo`` does not wait for them)."""
        if self.failed:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._save_failed(self.saving, e) from None
        self.manager.close()
        logging.getLogger("absl").removeFilter(self._filter)


def restore_params(root: str, step: int, target):
    """Only the params of a checkpoint, onto ``target`` (ShapeDtypeStructs with shardings)."""
    restore_args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding), target)
    args = ocp.args.PyTreeRestore({"params": target}, restore_args={"params": restore_args}, partial_restore=True)
    problem = verify(root, step)  # before orbax: a failed read there ends noisily
    if problem:
        raise DamagedCheckpoint(root, step, problem)
    try:
        restored = _manager(root, read_only=True).restore(step, args=ocp.args.Composite(state=args))
    except Exception as e:  # noqa: BLE001 - damaged files, or another model's params
        raise _restore_failure(root, step, e, "its params do not match the model") from None
    return restored.state["params"]
