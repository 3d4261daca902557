import os
import sys
import threading
import time

from shardzoo.cli import main

EXIT_GRACE_S = 20  # how long background threads (orbax's saves) may hold up a finished command

status = main()
sys.stdout.flush()
sys.stderr.flush()
# A background thread stuck after a failure (orbax waiting on a save that will never finish)
# must not keep a command that has already reported its outcome from exiting.
deadline = time.monotonic() + EXIT_GRACE_S
for thread in threading.enumerate():
    if thread is not threading.main_thread() and not thread.daemon:
        thread.join(max(deadline - time.monotonic(), 0))
if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
    os._exit(status)
raise SystemExit(status)
