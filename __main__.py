"""``python -m shardzoo`` and the ``shardzoo`` command: the command line (``cli.main``) with Ctrl-C
answered by a thread of its own and a failed command ending without the interpreter's shutdown."""

import os
import sys
import threading
import time

from shardzoo import interrupt

EXIT_GRACE_S = 5  # how long background threads may hold up a command that has succeeded


def _lingering():
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]


def run() -> None:
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
