"""Cost of the periodic post-mortem snapshot, measured in one run (CPU).

    python benchmarks/bench_postmortem.py [--steps 3000] [--every 30] [--pairs 3] [--fast 0.2]

A small model trains with the probe on and every step traced (so the rings are as full as
they get), then:

1. the snapshot the periodic thread writes (``record.write("snapshot")``) is timed ten
   times; its share of wall time is (time per snapshot) / PROBE_POSTMORTEM_EVERY, spent on
   the snapshot thread, which holds the GIL for about that long once a period;
2. A/B at the default period: blocks of training of 1.2 x ``--every`` seconds with the real
   snapshot thread (``probe.postmortem.hooks``, writing once a period) and without it,
   alternating, ``--pairs`` pairs; the ratio of the median step times is the cost on the
   training step itself (goal: at most 1.002);
3. the same A/B with a snapshot every ``--fast`` seconds (150x the default rate), where
   the effect is large enough to rise above the noise of a shared machine; its excess
   scaled back to the default period is a second estimate of (2).
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
    ap.add_argument("--every", type=float, default=30.0, help="The period of the A/B at defaults (PROBE_POSTMORTEM_EVERY's default).")
    ap.add_argument("--pairs", type=int, default=3, help="Alternating on/off pairs of each A/B.")
    ap.add_argument("--fast", type=float, default=0.2, help="The short period of the amplified A/B.")
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

    import threading

    from probe.postmortem import hooks

    def block(every: float | None, seconds: float) -> float:
        """Mean step time over ``seconds`` of training, with the snapshot thread writing every ``every`` s (None: off)."""
        t = None
        if every is not None:
            hooks._stop.clear()
            t = threading.Thread(target=hooks._snapshots, args=(every,), name="probe-postmortem", daemon=True)
            t.start()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            step()
            n += 1
        dt = (time.perf_counter() - t0) / n
        if t is not None:
            hooks._stop.set()
            t.join()
        return dt

    def ab(every: float, seconds: float, pairs: int) -> tuple[float, float, float]:
        on, off = [], []
        for _ in range(pairs):
            off.append(block(None, seconds))
            on.append(block(every, seconds))
        return statistics.median(on) / statistics.median(off), statistics.median(on), statistics.median(off)

    ratio, on, off = ab(args.every, 1.2 * args.every, args.pairs)
    print(f"A/B at the default period ({args.every:g} s, {args.pairs} pairs of {1.2 * args.every:g} s blocks, alternating): "
          f"step time with the periodic snapshot / without: {ratio:.4f}x ({on * 1e3:.3f} ms vs {off * 1e3:.3f} ms; "
          f"goal <= 1.002x)")
    ratio, on, off = ab(args.fast, 10.0, args.pairs)
    print(f"A/B with a snapshot every {args.fast:g} s ({args.every / args.fast:.0f}x the default rate): {ratio:.3f}x "
          f"({on * 1e3:.3f} ms vs {off * 1e3:.3f} ms); scaled to one every {args.every:g} s: "
          f"{1 + (ratio - 1) * args.fast / args.every:.5f}x")


if __name__ == "__main__":
    sys.exit(main())
