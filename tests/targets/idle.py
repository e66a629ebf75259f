"""A plain Python process with the probe and no torch: a worker thread and a busy-ish main loop."""

import os
import sys
import threading
import time

if os.environ.get("TARGET_NO_PROBE") != "1":
    import probe.auto  # noqa: F401


def data_worker():
    while True:
        time.sleep(0.2)  # ok-sleep: the target simulates work


def main_loop():
    n = 0
    while True:
        n += 1
        time.sleep(0.05)  # ok-sleep: the target simulates work


threading.Thread(target=data_worker, name="data-worker", daemon=True).start()
if os.environ.get("IDLE_USER_RULE") == "1":  # a rule of the script's own, as a user would declare it
    import probe

    probe.rule(
        "too_many_threads",
        family="probe",
        severity="warning",
        description="The process runs more than one Python thread (a test rule).",
        sql="SELECT rank, count(*) AS n FROM python.threads GROUP BY rank HAVING count(*) > 1",
        message="{n} Python threads are running.",
        next=['probe {target} query "SELECT * FROM python.threads"'],
    )
print(f"ready {os.getpid()} torch={'torch' in sys.modules}", flush=True)
main_loop()
