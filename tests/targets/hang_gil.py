"""A main thread stuck in a C call with the GIL held: libc sleep through ctypes.PyDLL (which keeps the GIL)."""

import ctypes
import os
import sys

libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call, so no Python thread can run


def stuck_in_c():
    libc.sleep(int(sys.argv[1]) if len(sys.argv) > 1 else 120)  # the stuck frame


if os.environ.get("TARGET_WITH_PROBE") == "1":
    import probe.auto  # noqa: F401
print(f"ready {os.getpid()}", flush=True)
stuck_in_c()
