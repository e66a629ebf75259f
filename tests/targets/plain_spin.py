"""A probed process whose main thread spins in pure Python (always executing bytecode)."""

import os

import probe.auto  # noqa: F401


def spin():
    n = 0
    while True:
        n += 1


print(f"ready {os.getpid()}", flush=True)
spin()
