"""Guarding a run directory: one process at a time, and never over files that are not ours.

``DirLock`` holds ``DIR/.shardzoo.lock`` with ``fcntl.flock`` for the life of a run (or of an
export into DIR). The kernel drops a flock when its holder dies, so a lock file that nobody
holds is stale: it is taken over with one warning line. The file records the holder's pid,
host and start time, which a refused second process names.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys

from shardzoo.errors import UserError

LOCK_FILE = ".shardzoo.lock"
# What ``shardzoo train`` writes in OUT; a directory holding one of them must be a shardzoo run.
RUN_FILES = ("run.json", "metrics.jsonl", "tokenizer", "checkpoints", "tensorboard", "loss.png",
             "damaged-checkpoints")


class RunDirError(UserError):
    """A run or export directory that is in use, not writable, or holds someone else's files."""


def _warn(text: str) -> None:
    print(f"shardzoo: warning: {text}", file=sys.stderr, flush=True)


class DirLock:
    """An exclusive lock on directory ``path`` (``what`` names it in messages, e.g. ``--out``).

    ``acquire`` creates the directory when it is missing; ``release`` removes the lock file and
    the directories ``acquire`` created, when they hold nothing else (a refused run leaves no trace).
    """

    def __init__(self, path: str, what: str = "--out"):
        self.path, self.what = os.path.abspath(os.path.expanduser(path)), what
        self.lock_path = os.path.join(self.path, LOCK_FILE)
        self.fd: int | None = None
        self.created: list[str] = []

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()

    def acquire(self) -> None:
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise RunDirError(f"{self.what} {self.path} is a file, not a directory: choose another {self.what}")
        self._makedirs()
        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                self.release()
                raise RunDirError(f"{self.what} {self.path} is not writable: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                self.release()
                raise RunDirError(
                    f"{self.what} {self.path} is in use by pid {holder.get('pid', '?')} on host "
                    f"{holder.get('host', '?')} (since {holder.get('started', '?')}): wait for it to "
                    f"end or choose another {self.what}"
                ) from None
            # the file may have been unlinked by its last holder between our open and flock
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        holder = _read_holder(fd)
        if holder:
            if holder.get("host") not in (None, socket.gethostname()):
                os.close(fd)
                self.fd = None
                self.release()
                raise RunDirError(
                    f"{self.what} {self.path} was locked by pid {holder.get('pid')} on host "
                    f"{holder['host']}, which this machine cannot check: if that run has ended, "
                    f"delete {self.lock_path}"
                )
            _warn(f"{self.what} {self.path}: taking over the stale lock of pid {holder.get('pid')} "
                  f"(since {holder.get('started', '?')}), which is no longer running")
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except OSError as e:
            self.release()
            raise RunDirError(f"{self.what} {self.path} is not writable: {e.strerror}") from None

    def _makedirs(self) -> None:
        missing, path = [], self.path
        while not os.path.exists(path):
            missing.append(path)
            path = os.path.dirname(path)
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                continue
            except OSError as e:
                self.release()
                raise RunDirError(f"{self.what} {self.path}: cannot create {d}: {e.strerror}") from None
            self.created.append(d)

    def release(self) -> None:
        """Drop the lock; remove the lock file and the (still empty) directories we created."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.lock_path)
            os.close(self.fd)
            self.fd = None
        for d in reversed(self.created):
            try:
                os.rmdir(d)
            except OSError:
                break
        self.created = []


def _read_holder(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def read_run_json(path: str) -> dict | None:
    """``path/run.json`` parsed (None when there is none); a RunDirError when it does not parse."""
    where = os.path.join(path, "run.json")
    try:
        with open(where, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RunDirError(f"{where} cannot be read: {e.strerror}") from None
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        reason = "empty" if not data.strip() else f"not JSON: {str(e).splitlines()[0]}"
        raise RunDirError(f"{where} is garbled ({reason})") from None


def is_shardzoo_run(path: str) -> bool:
    """Whether ``path/run.json`` is one that ``shardzoo train`` or ``import-hf`` wrote (a
    RunDirError when it is garbled)."""
    run = read_run_json(path)
    return isinstance(run, dict) and "model" in run and ("settings" in run or run.get("command") == "import-hf")


def check_run_dir(path: str, what: str = "--out") -> None:
    """Refuse a directory holding files that ``train`` would write but that are not a run's."""
    if not os.path.isdir(path):
        return
    try:
        if is_shardzoo_run(path):
            return
    except RunDirError as e:
        raise RunDirError(f"{what} {path}: {e}, so it cannot be told from a directory of someone "
                          f"else's files: restore run.json or choose another {what}") from None
    foreign = [n for n in RUN_FILES if os.path.lexists(os.path.join(path, n))]
    if foreign:
        raise RunDirError(
            f"{what} {path} holds {', '.join(foreign)} but is not a shardzoo run (no run.json of one): "
            f"choose another {what} or move those files away"
        )


def check_empty_target(path: str, what: str, overwrite: bool = False) -> None:
    """An export target must be a missing or empty directory, or ``overwrite`` must be given."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise RunDirError(f"{what} {path} is an existing file, not a directory: choose another {what}")
    try:
        names = [n for n in os.listdir(path) if n != LOCK_FILE]
    except OSError as e:
        raise RunDirError(f"{what} {path} cannot be read: {e.strerror}") from None
    if names and not overwrite:
        shown = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
        raise RunDirError(f"{what} {path} is not empty ({shown}): choose an empty directory or pass --overwrite")


def describe_os_error(e: OSError) -> tuple[str, bool]:
    """``(reason, is_user_error)``: a read-only or forbidden target is the user's; a full disk is not."""
    user = e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.ENOENT)
    return e.strerror or str(e), user


def locked(path: str, what: str):
    """The directory lock of a command that writes ``path``, held by process 0 only."""
    import contextlib

    import jax

    return DirLock(path, what) if jax.process_index() == 0 else contextlib.nullcontext()
