"""A probed process without torch, for the tests about the process under its clients (hostile ones, imports):
``probe.start()`` with the settings of its environment, then a plain loop that prints ``step N`` every 20 ms, so
that a test can tell the process kept running whatever its clients did. ``probe.stop()`` on SIGTERM."""

import os
import signal
import sys
import time

import probe

probe.start()


def _stop(signum, frame):
    probe.stop()
    sys.exit(0)


signal.signal(signal.SIGTERM, _stop)
print(f"ready {os.getpid()}", flush=True)
step = 0
while True:
    step += 1
    print(f"step {step}", flush=True)
    time.sleep(0.02)  # ok-sleep: the target's step
