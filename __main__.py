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


# A background thread left behind by a failure (orbax's, after a save that failed) must neither
# keep a command that has reported its outcome from exiting nor add tracebacks to its one line.
if status != 0 and _lingering():
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
