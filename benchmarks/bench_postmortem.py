"""Cost of the periodic post-mortem snapshot, measured in one run (CPU).

    python benchmarks/bench_postmortem.py [--steps 3000] [--every 30]

A small model trains with the probe on and every step traced (so the rings are as full as
they get), then the snapshot the periodic thread writes (``record.write("snapshot")``) is
timed ten times. Its share of wall time is (time per snapshot) / PROBE_POSTMORTEM_EVERY:
the thread holds the GIL for about that long once a period, off the training thread. A
second arm times training steps with the snapshot thread writing every 0.2 s against steps
without it, alternating, to show the effect on the step itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("PROBE_RUNTIME_DIR", tempfile.mkdtemp(prefix="pr-bench-", dir="/tmp"))
os.environ.setdefault("PROBE_TRACE", "all")
os.environ["PROBE_POSTMORTEM_EVERY"] = "0"  # this script drives the snapshots itself

import torch  # noqa: E402

import probe.auto  # noqa: E402,F401
from probe.postmortem import record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--every", type=float, default=30.0)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        x = torch.randn(32, 64)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in range(args.steps):
        step()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        assert record.write("snapshot") is not None
        times.append(time.perf_counter() - t0)
    per = statistics.median(times)
    print(f"snapshot of full rings ({args.steps} steps traced): median {per * 1000:.1f} ms "
          f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}); "
          f"share of wall time at one snapshot every {args.every:g} s: {100 * per / args.every:.3f} %")

    # A/B on the step: a snapshot thread writing as fast as every 0.2 s vs none, alternating blocks.
    import threading

    def blocks(with_snapshots: bool, n: int = 200) -> float:
        stop = threading.Event()
        t = None
        if with_snapshots:
            t = threading.Thread(target=lambda: [record.write("snapshot") for _ in iter(lambda: stop.wait(0.2), True)],
                                 daemon=True)
            t.start()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        dt = (time.perf_counter() - t0) / n
        stop.set()
        if t is not None:
            t.join()
        return dt

    on, off = [], []
    for _ in range(5):
        off.append(blocks(False))
        on.append(blocks(True))
    print(f"step time with a snapshot every 0.2 s / without: {statistics.median(on) / statistics.median(off):.3f}x "
          f"({statistics.median(on) * 1e3:.2f} ms vs {statistics.median(off) * 1e3:.2f} ms; "
          f"150x more often than the default {args.every:g} s)")


if __name__ == "__main__":
    sys.exit(main())
