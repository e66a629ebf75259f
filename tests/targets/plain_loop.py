"""A plain Python script that never imports probe: a worker thread and a main loop of short sleeps."""

import os
import sys
import threading
import time


def worker():
    while True:
        time.sleep(0.2)  # ok-sleep: the target simulates work


def main_loop():
    while True:
        time.sleep(0.05)  # ok-sleep: the target simulates work


threading.Thread(target=worker, name="plain-worker", daemon=True).start()
print(f"ready {os.getpid()} probe={'probe' in sys.modules}", flush=True)
main_loop()
