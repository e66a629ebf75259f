"""A main thread blocked on a queue get and a worker blocked on a lock (the GIL released in both)."""

import os
import queue
import threading

lock = threading.Lock()
lock.acquire()
jobs: queue.Queue = queue.Queue()


def waiter():
    with lock:  # blocks forever: the lock is never released
        pass


def wait_for_job():
    return jobs.get()  # blocks forever: nothing is ever put


threading.Thread(target=waiter, name="lock-waiter", daemon=True).start()
print(f"ready {os.getpid()}", flush=True)
wait_for_job()
