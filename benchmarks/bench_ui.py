"""What `probe ui` costs the training job, and how fast the page loads.

One run of examples/train_gpt.py; windows of training alternate between the page closed
and the page open in headless Chromium, refreshing every --refresh seconds (every panel:
job, curves, time per module, stacks, actions). Each window's step times come from
torch.steps; the ratio open/closed of the median step time is the page's cost. Two
closed windows compared with each other (A/A) show the noise of the machine. Then the same
for windows during which `probe profile` samples every thread at 100 Hz.

    python benchmarks/bench_ui.py [--window 12] [--rounds 3] [--refresh 3] [--loads 5]

Needs Debian's chromium (/usr/bin/chromium) and playwright (requirements/test.txt).
"""

from __future__ import annotations

import argparse
import json
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
from harness import clean_env, start, stop_groups  # noqa: E402  (tests/harness.py: the one harness tests and benchmarks share)

PROBE = (
    str(Path(sys.executable).with_name("probe"))
    if Path(sys.executable).with_name("probe").exists()
    else shutil.which("probe")
)


def _query(env, pid, sql):
    r = subprocess.run(
        [PROBE, str(pid), "query", sql, "--format", "json"], capture_output=True, text=True, env=env, timeout=60
    )
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout)


def _max_step(env, pid) -> int:
    return int(_query(env, pid, "SELECT MAX(step) AS s FROM torch.steps")[0]["s"] or 0)


def _cpu_seconds(pid) -> float:
    """utime + stime of the whole training process (every thread, the probe's server included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CPU_PER_STEP: list = []  # (phase, CPU seconds of the training process per step) per window


def _window(env, pid, seconds, phase="") -> list[float]:
    a = _max_step(env, pid)
    c0 = _cpu_seconds(pid)
    time.sleep(seconds)  # ok-sleep: the measured window of training
    c1 = _cpu_seconds(pid)
    b = _max_step(env, pid)
    CPU_PER_STEP.append((phase, (c1 - c0) / max(1, b - a)))
    rows = _query(env, pid, f"SELECT duration FROM torch.steps WHERE step > {a} AND step <= {b}")
    return [r["duration"] for r in rows if r["duration"] is not None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=12.0, help="Seconds per window (default 12).")
    ap.add_argument("--rounds", type=int, default=3, help="Closed/open pairs (default 3).")
    ap.add_argument(
        "--refresh", type=float, default=3.0, help="The page's refresh period (default 3, the default of probe ui)."
    )
    ap.add_argument("--loads", type=int, default=5, help="Page loads timed (default 5).")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    rt = tempfile.mkdtemp(prefix="pbui-", dir="/tmp")
    env = clean_env(rt)  # no PROBE* setting of ours, its own runtime dir, unbuffered, one OpenMP thread
    train = start([ROOT / "examples" / "train_gpt.py", "--print-every", "1000000"], env, ready=None)
    ui = None
    try:
        pid = int(train.wait_match(r"ready pid=(\d+)", timeout=180)[0].group(1))
        ui = start([PROBE, pid, "ui", "--port", "0", "--refresh", args.refresh], env, ready=None)
        url = ui.wait_match(r"http://127\.0\.0\.1:\d+/\S+/", timeout=30)[0].group(0)
        _window(env, pid, 3.0)  # warm-up: first steps, tracing switched on, caches
        closed, opened, requests = [], [], 0
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
            for _ in range(args.rounds):
                closed.append(_window(env, pid, args.window, "closed"))
                page = browser.new_page(viewport={"width": 1400, "height": 1600})
                seen = []
                page.on("request", lambda r, seen=seen: seen.append(r.url))  # this page only: closed in this round
                page.goto(url)
                page.wait_for_selector("body[data-loaded='1']", timeout=60000)
                opened.append(_window(env, pid, args.window, "open"))
                page.close()
                requests += len(seen)
            # a 100 Hz profile (GET /profile, the page's flamegraph button) over a whole window
            profiled = []
            for _ in range(args.rounds):
                prof = subprocess.Popen(
                    [PROBE, str(pid), "profile", "--seconds", str(args.window + 2)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(1)  # ok-sleep: let the sampler start before the window opens
                profiled.append(_window(env, pid, args.window, "profile"))
                prof.wait(60)
            loads = []
            for _ in range(args.loads):
                page = browser.new_page(viewport={"width": 1400, "height": 1600})
                t0 = time.perf_counter()
                page.goto(url)
                page.wait_for_selector("body[data-loaded='1']", timeout=60000)
                loads.append(time.perf_counter() - t0)
                page.close()
            browser.close()
    finally:
        stop_groups([proc.popen for proc in (ui, train) if proc is not None])
        shutil.rmtree(rt, ignore_errors=True)

    med = statistics.median
    c_all = [d for w in closed for d in w]
    o_all = [d for w in opened for d in w]
    print(
        f"train_gpt.py on CPU, OMP_NUM_THREADS=1; {args.rounds} rounds of {args.window:g} s closed / {args.window:g} s "
        "open, "
        f"page refreshing every {args.refresh:g} s"
    )
    print(f"{'window':<10} {'steps':>6} {'median step s':>14}")
    for i, (c, o) in enumerate(zip(closed, opened)):
        print(f"closed {i:<3} {len(c):>6} {med(c):>14.5f}")
        print(f"open   {i:<3} {len(o):>6} {med(o):>14.5f}")
    aa = [med(closed[i]) / med(closed[i - 1]) for i in range(1, len(closed))]
    print(f"step-time ratio open/closed (median of all steps): {med(o_all) / med(c_all):.3f}")
    print(f"per-round ratios open/closed: {', '.join(f'{med(o) / med(c):.3f}' for c, o in zip(closed, opened))}")
    if aa:
        print(f"A/A noise (closed window over the previous closed window): {', '.join(f'{r:.3f}' for r in aa)}")
    cpu_c = med([c for ph, c in CPU_PER_STEP if ph == "closed"])
    cpu_o = med([c for ph, c in CPU_PER_STEP if ph == "open"])
    print(
        f"CPU seconds of the training process per step (all its threads, the probe's included): "
        f"closed {cpu_c * 1000:.2f} ms, open {cpu_o * 1000:.2f} ms, ratio {cpu_o / cpu_c:.3f}"
    )
    cpu_p = med([c for ph, c in CPU_PER_STEP if ph == "profile"])
    p_all = [d for w in profiled for d in w]
    print(
        f"while a 100 Hz profile samples: median step time ratio {med(p_all) / med(c_all):.3f}, "
        f"CPU per step {cpu_p * 1000:.2f} ms, ratio {cpu_p / cpu_c:.3f} (against the closed windows)"
    )
    print(f"page requests while open: {requests / (args.rounds * args.window):.1f} per second")
    print(
        f"page load to first data (goto until every panel answered): median {med(loads):.2f} s, "
        f"min {min(loads):.2f} s, max {max(loads):.2f} s over {len(loads)} loads"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
