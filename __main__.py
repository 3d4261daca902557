import os
import sys
import threading
import time

from shardzoo.cli import main

EXIT_GRACE_S = 5  # how long background threads may hold up a command that has finished

status = main()
sys.stdout.flush()
sys.stderr.flush()
# A background thread left behind by a failure (orbax's, after a save that failed) must not keep
# a command that has already reported its outcome from exiting.
deadline = time.monotonic() + EXIT_GRACE_S
for thread in threading.enumerate():
    if thread is not threading.main_thread() and not thread.daemon:
        try:
            thread.join(max(deadline - time.monotonic(), 0))
        except Exception:  # noqa: BLE001 - some threads re-raise their failure on join
            pass
if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
    os._exit(status)
raise SystemExit(status)
