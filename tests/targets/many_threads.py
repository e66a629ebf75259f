"""A plain Python process with the probe and many idle threads (``argv[1]``, 300 by default), each waiting in
``park``. Prints ``ready`` once they all wait."""

import os
import sys
import threading

import probe.auto  # noqa: F401


def park(started):
    started.release()
    threading.Event().wait()  # never set: the thread idles for the process's life


count = int(sys.argv[1]) if len(sys.argv) > 1 else 300
threading.stack_size(256 * 1024)
started = threading.Semaphore(0)
for i in range(count):
    threading.Thread(target=park, args=(started,), name=f"parked-{i}", daemon=True).start()
for _ in range(count):
    started.acquire()
print(f"ready {os.getpid()}", flush=True)
threading.Event().wait()
