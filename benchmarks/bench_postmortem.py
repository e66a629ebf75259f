"""Cost of the periodic post-mortem snapshot, measured in one run (CPU).

    python benchmarks/bench_postmortem.py [--steps 3000] [--every 30] [--pairs 3] [--short 1] [--short-pairs 30]

A small model trains with the probe on and every step traced (so the rings are as full as
they get), then:

1. the snapshot the periodic thread writes (``record.write("snapshot")``) is timed ten
   times; its share of wall time is (time per snapshot) / PROBE_POSTMORTEM_EVERY, spent on
   the snapshot thread, which holds the GIL for about that long once a period;
2. A/B at the default period: blocks of training of 1.2 x ``--every`` seconds with the real
   snapshot thread (``probe.postmortem.hooks``, writing once a period) and without it,
   alternating, ``--pairs`` pairs; the ratio of the median step times is the cost on the
   training step itself (goal: at most 1.002);
3. per snapshot, precise where (2) drowns in the noise of a shared machine: short blocks
   (``--short`` s) alternating, with one snapshot written on the side at the start of each
   "on" block; the median extra wall time the training loop spends in an "on" block is
   the cost of one snapshot to training, and over PROBE_POSTMORTEM_EVERY it is the share of
   step time at defaults (a second estimate of (2)).
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
    ap.add_argument(
        "--every",
        type=float,
        default=30.0,
        help="The period of the A/B at defaults (PROBE_POSTMORTEM_EVERY's default).",
    )
    ap.add_argument("--pairs", type=int, default=3, help="Alternating on/off pairs of each A/B.")
    ap.add_argument("--short", type=float, default=1.0, help="Block length of the per-snapshot A/B, seconds.")
    ap.add_argument("--short-pairs", type=int, default=30, help="Pairs of the per-snapshot A/B.")
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
    print(
        f"snapshot of full rings ({args.steps} steps traced): median {per * 1000:.1f} ms "
        f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}); "
        f"share of wall time at one snapshot every {args.every:g} s: {100 * per / args.every:.3f} %"
    )

    import threading

    from probe.postmortem import hooks

    def block(every: float | None, seconds: float) -> float:
        """Mean step time over ``seconds`` of training, with the snapshot thread writing every ``every`` s
        (None: off)."""
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
    print(
        f"A/B at the default period ({args.every:g} s, {args.pairs} pairs of {1.2 * args.every:g} s blocks, "
        "alternating): "
        f"step time with the periodic snapshot / without: {ratio:.4f}x ({on * 1e3:.3f} ms vs {off * 1e3:.3f} ms; "
        f"goal <= 1.002x)"
    )
    # per snapshot: short blocks, alternating, one snapshot written on the side at the start of each "on" block;
    # the extra wall time it costs the training loop, over the default period, is the cost at defaults
    extra, ratios = [], []
    for _ in range(args.short_pairs):
        off_dt = block(None, args.short)
        t = threading.Thread(target=record.write, args=("snapshot",), daemon=True)
        t.start()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.short:
            step()
            n += 1
        on_dt = (time.perf_counter() - t0) / n
        t.join()
        extra.append((on_dt - off_dt) * n)
        ratios.append(on_dt / off_dt)
    per = statistics.median(extra)
    print(
        f"per snapshot ({args.short_pairs} pairs of {args.short:g} s blocks, alternating): the training loop loses "
        f"{per * 1e3:.1f} ms (median; block ratio {statistics.median(ratios):.3f}x); at one every {args.every:g} s: "
        f"{100 * per / args.every:.3f} % of step time (goal <= 0.2 %)"
    )


if __name__ == "__main__":
    sys.exit(main())
