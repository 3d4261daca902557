import os
import sys
import threading
import time

from shardzoo.cli import main

EXIT_GRACE_S = 5  # how long background threads may hold up a command that has succeeded

status = main()
sys.stdout.flush()
sys.stderr.flush()


def _lingering():
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]


# A failed command has said why in one line: background work left behind by the failure (orbax's
# threads and tensorstore's callbacks after a save that failed) must neither keep it from exiting
# nor add tracebacks after that line, so it ends here, without the interpreter's shutdown.
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
