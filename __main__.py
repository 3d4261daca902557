"""``python -m shardzoo`` and the ``shardzoo`` command: the command line (``cli.main``) with Ctrl-C
answered by a thread of its own and a failed command ending without the interpreter's shutdown."""

import contextlib
import os
import sys
import threading
import time

from shardzoo import host_memory, interrupt

EXIT_GRACE_S = 5  # how long background threads may hold up a command that has succeeded


def _lingering():
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]


class _Tolerant:
    """A text stream whose writes never fail the command: once the reader of its pipe is gone
    (``| head``, a ``| tee`` killed by the same Ctrl-C, a closed terminal), its descriptor is
    pointed at /dev/null and what follows is dropped, so a save never depends on printing."""

    def __init__(self, stream):
        self._stream = stream

    def _guard(self, call, *args):
        try:
            return call(*args)
        except (OSError, ValueError):  # EPIPE, EIO; ValueError: closed by someone else
            with contextlib.suppress(OSError, ValueError):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, self._stream.fileno())
                os.close(null)
                self._stream.flush()  # what the buffer held goes to /dev/null too
            return len(args[0]) if args else None

    def write(self, text):
        return self._guard(self._stream.write, text)

    def flush(self):
        return self._guard(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def guard_streams() -> None:
    """stdout and stderr that cannot fail the command: a closed descriptor 1 or 2 (``2>&-``) is
    opened on /dev/null first (else the next file opened would take its number and receive the
    logs), and both streams drop what a gone reader cannot take (``_Tolerant``)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, "w", buffering=1, closefd=False))
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Tolerant):
            setattr(sys, name, _Tolerant(stream))


def run() -> None:
    guard_streams()
    host_memory.keep_freed_memory()  # before jax's threads take arenas of their own
    # before cli's imports start jax's threads, so that no thread but the watcher receives SIGINT
    interrupt.watch(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "")
    from shardzoo.cli import main

    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A failed command has said why in one line: background work left behind by the failure
    # (orbax's threads and tensorstore's callbacks after a save that failed) must neither keep it
    # from exiting nor add tracebacks after that line, so it ends here, without the interpreter's
    # shutdown.
    if status != 0:
        os._exit(status)
    deadline = time.monotonic() + EXIT_GRACE_S
    for thread in _lingering():
        try:
            thread.join(max(deadline - time.monotonic(), 0))
        except Exception:  # noqa: BLE001 - some threads re-raise their failure on join
            pass
    if _lingering():
        os._exit(status)
    raise SystemExit(status)


if __name__ == "__main__":
    run()
