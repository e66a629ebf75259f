"""Costs of the interop features, measured side by side in one run.

    python benchmarks/bench_interop.py [--steps 20] [--spans 200000]

1. ``probe.span``: ns per ``with probe.span(...)`` block with no probe running, and with one
   (recorded into python.spans), against an empty ``with nullcontext()`` block.
2. ``profile-steps``: the median step time of examples/train_gpt.py before, during and after
   ``probe PID profile-steps N`` (the profiler must cost nothing once its N steps are over).
3. ``probe trace``: wall time of the command end to end for the last 10 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from harness import clean_env  # noqa: E402  (tests/harness.py: the one harness tests and benchmarks share)

PROBE = (
    str(Path(sys.executable).with_name("probe"))
    if Path(sys.executable).with_name("probe").exists()
    else shutil.which("probe")
)

SPAN_BENCH = r"""
import sys, timeit, contextlib
import probe
n = int(sys.argv[1])
if sys.argv[2] == "on":
    probe.start()
null = contextlib.nullcontext()
s = probe.span("data")
def base():
    with null:
        pass
def span():
    with s:
        pass
b = min(timeit.repeat(base, number=n, repeat=3)) / n * 1e9
t = min(timeit.repeat(span, number=n, repeat=3)) / n * 1e9
print(f"{b:.1f} {t:.1f}")
"""


def probe_cli(env, *args):
    r = subprocess.run([PROBE, *map(str, args)], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"probe {' '.join(map(str, args))} failed: {r.stderr}")
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="Steps to profile.")
    ap.add_argument("--spans", type=int, default=200000, help="Span blocks per timing.")
    args = ap.parse_args()
    rt = tempfile.mkdtemp(prefix="pb-", dir="/tmp")
    env = clean_env(rt)  # no PROBE* setting of ours, its own runtime dir, unbuffered, one OpenMP thread

    for mode in ("off", "on"):
        out = subprocess.run(
            [sys.executable, "-c", SPAN_BENCH, str(args.spans), mode],
            capture_output=True,
            text=True,
            env=env,
            cwd=rt,
            timeout=600,
        )
        base, span = map(float, out.stdout.split())
        print(
            f"probe.span, probe {mode:3}: {span:7.1f} ns per block (empty nullcontext block {base:.1f} ns; "
            f"+{span - base:.1f} ns)"
        )

    p = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--print-every", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=rt,
        start_new_session=True,
    )
    try:
        for line in p.stdout:
            if line.startswith("ready"):
                break
        pid = p.pid

        def last_step():
            rows = json.loads(
                probe_cli(env, pid, "--format", "json", "query", "SELECT MAX(step) AS s FROM torch.steps").stdout
            )
            return rows[0]["s"] or 0

        while last_step() < 100:  # past warm-up
            time.sleep(0.2)  # ok-sleep: polling the job's progress
        t0 = time.perf_counter()
        probe_cli(env, pid, "trace", "--steps", "10", "-o", Path(rt) / "trace.json")
        trace_s = time.perf_counter() - t0
        probe_cli(env, pid, "profile-steps", args.steps, "-o", Path(rt) / "prof.json")
        end = last_step()
        while last_step() < end + 3 * args.steps:
            time.sleep(0.2)  # ok-sleep: polling the job's progress
        rows = json.loads(
            probe_cli(
                env,
                pid,
                "--format",
                "json",
                "query",
                f"""
            WITH p AS (SELECT step FROM probe.actions WHERE command = 'profile-steps')
            SELECT CASE WHEN s.step <= p.step THEN 'before' WHEN s.step <= p.step + {args.steps} THEN 'during'
                        ELSE 'after' END AS phase, COUNT(*) AS n, MEDIAN(s.duration) AS median_s
            FROM torch.steps s, p
            WHERE s.step > p.step - {3 * args.steps} AND s.step <= p.step + {3 * args.steps}
              AND s.step <> p.step + {args.steps}  -- the step whose boundary exports the trace
            GROUP BY ALL""",
            ).stdout
        )
        by = {r["phase"]: r for r in rows}
        before = by["before"]["median_s"]
        for phase in ("before", "during", "after"):
            r = by[phase]
            print(
                f"train_gpt.py median step {phase:6}: {r['median_s'] * 1e3:7.2f} ms over {r['n']:3} steps "
                f"(x{r['median_s'] / before:.3f} of before)"
            )
        print(f"probe PID trace --steps 10: {trace_s:.2f} s end to end")
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(10)
        shutil.rmtree(rt, ignore_errors=True)


if __name__ == "__main__":
    main()
