"""Ctrl-C as a request the program answers, never an exception raised wherever Python happens to be.

``python -m shardzoo`` and the ``shardzoo`` command (``__main__.py``) block SIGINT in every thread before jax starts any and
waits for it in one thread of its own (``watch``). That thread sees each Ctrl-C at once, even while
the main thread is inside XLA (a compile, a step), and answers it here:

- while a Trainer's loop runs (``stoppable``): the first Ctrl-C asks the run to stop, save its step
  and end with exit 130 (the Trainer's own message); a second one ends the process at once;
- at any other moment (start-up, compiling, another command): the process ends at once with one
  line and exit 130, once the write in progress that must not be cut (``uncut``: run.json, the
  tokenizer files) is done, so the run directory stays as a resume expects it; what ``undone``
  registered runs first (a lock and an ``--out`` this command created and left empty go).

Used in-process (tests calling ``cli.main``), none of this is installed and Python's own
KeyboardInterrupt and the Trainer's signal handler behave as before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

EXIT = 130
UNCUT_WAIT_S = 5.0  # how long a Ctrl-C waits for a write that must not be cut

_lock = threading.Lock()
_stoppers: list = []  # callables(signum) of the Trainer loops that run now
_writing = 0  # writes in progress that an exit must not cut
_undo: list = []  # callables run before a Ctrl-C ends the process (``undone``)
_count = 0  # Ctrl-Cs seen
_watching = False


@contextlib.contextmanager
def stoppable(stop):
    """While inside, a first Ctrl-C calls ``stop(signal.SIGINT)`` instead of ending the process."""
    with _lock:
        _stoppers.append(stop)
    try:
        yield
    finally:
        with _lock:
            _stoppers.remove(stop)


@contextlib.contextmanager
def uncut():
    """A write that a Ctrl-C waits for (at most ``UNCUT_WAIT_S``) before ending the process."""
    global _writing
    with _lock:
        _writing += 1
    try:
        yield
    finally:
        with _lock:
            _writing -= 1


@contextlib.contextmanager
def undone(fn):
    """While inside, a Ctrl-C that ends the process calls ``fn()`` first: e.g. an ``--out`` that
    this command created and has left empty is removed (``rundir.DirLock.release``)."""
    with _lock:
        _undo.append(fn)
    try:
        yield
    finally:
        with _lock:
            _undo.remove(fn)


def answer(command: str) -> None:
    """What one Ctrl-C does (called by ``watch``'s thread): stop the running loop, or end now."""
    global _count
    with _lock:
        _count += 1
        stopper = _stoppers[-1] if _stoppers and _count == 1 else None
    if stopper is not None:
        stopper(signal.SIGINT)
        return
    deadline = time.monotonic() + UNCUT_WAIT_S
    while _writing and time.monotonic() < deadline:
        time.sleep(0.01)
    for fn in reversed(list(_undo)):
        with contextlib.suppress(Exception):
            fn()
    name = f"shardzoo {command}" if command else "shardzoo"
    print(f"{name}: interrupted (Ctrl-C); nothing more was saved", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT)


def watch(command: str) -> None:
    """Block SIGINT in this thread and every thread started after it, and answer each one in a
    daemon thread of its own. Call it before anything starts threads (jax, orbax, tensorstore): a
    thread started earlier could still receive SIGINT. A second call does nothing."""
    global _watching
    if _watching:
        return
    _watching = True
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def loop():
        while True:
            signal.sigwait({signal.SIGINT})
            answer(command)

    threading.Thread(target=loop, name="shardzoo-ctrl-c", daemon=True).start()
