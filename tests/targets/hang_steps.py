"""A probed loop that completes a few steps, then stops stepping: blocked in C with the GIL held
(``gil``, the default) or waiting in Python-level sleep (``sleep``). Run with PROBE_HANG_TIMEOUT set."""

import ctypes
import os
import sys
import time

import probe.auto  # noqa: F401
from probe.training import boundary

mode = sys.argv[1] if len(sys.argv) > 1 else "gil"
libc = ctypes.PyDLL(None)


def stuck_after_steps():
    if mode == "gil":
        libc.sleep(120)  # stuck in C, GIL held
    else:
        time.sleep(120)  # ok-sleep: stuck, GIL released


for step in range(3):
    boundary.passed(step)
print(f"ready {os.getpid()} steps=3", flush=True)
stuck_after_steps()
