"""Fan-out latency: `probe --ranks all` to N local probed processes vs one rank, side by side.

    python benchmarks/bench_fanout.py [--ranks 16] [--repeat 5]

Starts N plain probed processes (tests/targets/idle.py with RANK/WORLD_SIZE set), then times the
real `probe` command end to end (process start-up included) for backtrace and a query, to one
rank and to all of them. Goal: <= 1 s for 16 ranks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from harness import clean_env, stop_groups  # noqa: E402  (tests/harness.py: the one harness tests and benchmarks share)

PROBE = (
    str(Path(sys.executable).with_name("probe"))
    if Path(sys.executable).with_name("probe").exists()
    else shutil.which("probe")
)


def timed(env, args, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = subprocess.run([PROBE, *args], capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - t0)
        if r.returncode != 0:
            raise SystemExit(f"probe {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    rt = tempfile.mkdtemp(prefix="pbf-", dir="/tmp")
    env = clean_env(rt)  # no PROBE* setting of ours, its own runtime dir, unbuffered, one OpenMP thread
    procs = []
    try:
        for r in range(a.ranks):
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(ROOT / "tests/targets/idle.py")],
                    stdout=subprocess.PIPE,
                    text=True,
                    env=dict(env, RANK=str(r), WORLD_SIZE=str(a.ranks)),
                    start_new_session=True,
                )
            )
        for p in procs:
            p.stdout.readline()  # the ready line
        sql = "SELECT rank, count(*) AS frames FROM python.backtrace GROUP BY rank"
        cases = [
            ("backtrace", ["--rank", "0", "backtrace"], ["--ranks", "all", "backtrace"]),
            ("backtrace --group", ["--rank", "0", "backtrace"], ["--ranks", "all", "backtrace", "--group"]),
            (
                "query",
                ["--rank", "0", "query", "SELECT count(*) FROM python.backtrace"],
                ["--ranks", "all", "query", sql],
            ),
            ("status", ["--rank", "0", "status"], ["--ranks", "all", "status"]),
        ]
        print(
            f"{a.ranks} local probed processes, median of {a.repeat} runs of the real `probe` command, "
            f"{os.cpu_count()} cores"
        )
        print(f"{'command':<20} {'1 rank':>9} {'all ranks':>10} {'ratio':>7}")
        for name, one, many in cases:
            t1, tn = timed(env, one, a.repeat), timed(env, many, a.repeat)
            print(
                f"{name:<20} {t1 * 1000:>7.0f}ms {tn * 1000:>8.0f}ms {tn / t1:>6.2f}x  "
                f"{'ok' if tn <= 1.0 else 'OVER 1 s'}"
            )
    finally:
        stop_groups(procs)
        shutil.rmtree(rt, ignore_errors=True)


if __name__ == "__main__":
    main()
