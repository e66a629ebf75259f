"""Scale: `probe --ranks all` against many light probed processes of one job on this host.

    python benchmarks/bench_ranks_scale.py [--ranks 256] [--repeat 3]

Starts N plain probed processes (tests/targets/idle.py: no torch) with fake rank identities
(RANK, WORLD_SIZE, one TORCHELASTIC_RUN_ID), waits for all of them, then times the real `probe`
command end to end: `--ranks all status` (the ranks.status view: ranks.latest, torch.process_groups
and ranks.issued from every rank), a federated query, and `backtrace --group`. Goal: status <= 3 s
for 256 ranks on the 2-core test machine. Refuses to start when the host lacks memory for N
processes. A query costs each rank one request (its snapshot); the client plans it once and runs
each per-rank part once for all ranks (``sql.pushdown.slot_query``).
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
from harness import stop_groups  # noqa: E402  (tests/harness.py: the one harness tests and benchmarks share)

PROBE = (
    str(Path(sys.executable).with_name("probe"))
    if Path(sys.executable).with_name("probe").exists()
    else shutil.which("probe")
)
PER_RANK_MB = 30  # ~21 MB PSS measured per idle rank, with a margin


def available_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0


def timed(env, args, repeat, ok=(0,)):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = subprocess.run([PROBE, *args], capture_output=True, text=True, env=env, timeout=300)
        times.append(time.perf_counter() - t0)
        if r.returncode not in ok:
            raise SystemExit(f"probe {' '.join(args)} failed ({r.returncode}): {r.stderr[:2000]}")
        out = r.stdout
    return statistics.median(times), min(times), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    need = a.ranks * PER_RANK_MB + 2048
    if available_mb() < need:
        raise SystemExit(
            f"{a.ranks} ranks need about {need} MB of free memory and {available_mb()} MB are available; "
            "pass a smaller --ranks."
        )
    rt = tempfile.mkdtemp(prefix="pbs-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROBE", "TORCHELASTIC", "SLURM", "MASTER_"))}
    env.update(PROBE_RUNTIME_DIR=rt, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    job = dict(env, WORLD_SIZE=str(a.ranks), TORCHELASTIC_RUN_ID="bench-scale")
    procs = []
    t0 = time.perf_counter()
    try:
        for r in range(a.ranks):
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(ROOT / "tests/targets/idle.py")],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    env=dict(job, RANK=str(r), LOCAL_RANK=str(r)),
                    start_new_session=True,
                )
            )
        for p in procs:
            if not p.stdout.readline():
                raise SystemExit("a rank exited before its ready line")
        started = time.perf_counter() - t0
        print(
            f"{a.ranks} probed processes ready in {started:.1f} s; timing the real probe command "
            f"(median of {a.repeat}, process start-up included):"
        )
        sql = "SELECT count(*) AS ranks, count(DISTINCT pid) AS pids, max(threads) AS threads FROM process.info"
        # the first query meets ranks that may still be settling after 256 start-ups: timed once, apart
        cold, _, _ = timed(env, ["--timeout", "300", "--ranks", "all", "--format", "json", "query", sql], 1)
        print(f"  {'first query (ranks just started)':45s} {cold:6.2f} s")
        cases = [
            ("status", ["--ranks", "all", "--format", "json", "status"]),
            ("federated query", ["--ranks", "all", "--format", "json", "query", sql]),
            ("backtrace --group", ["--ranks", "all", "backtrace", "--group"]),
            ("one rank: status", ["--rank", "0", "status"]),
        ]
        results = {}
        for name, args in cases:
            med, best, out = timed(env, ["--timeout", "60", *args], a.repeat)
            results[name] = med
            check = ""
            if args[-1] == "status" and "--ranks" in args:
                rows = json.loads(out)
                check = f" ({len(rows)} rows, states {sorted({r['state'] for r in rows})})"
                assert len(rows) == a.ranks, f"status returned {len(rows)} rows for {a.ranks} ranks"
            elif "query" in args:
                check = f" ({json.loads(out)[0]})"
                assert json.loads(out)[0]["ranks"] == a.ranks
            print(f"  {name:45s} {med:6.2f} s (best {best:.2f}){check}")
        rss = []
        for p in procs:
            try:
                with open(f"/proc/{p.pid}/smaps_rollup") as f:
                    rss += [int(line.split()[1]) for line in f if line.startswith("Pss:")]
            except OSError:
                pass
        if rss:
            print(f"  memory per rank after the queries: {statistics.median(rss) / 1024:.0f} MB PSS (median)")
        goal = results["status"] <= 3.0
        print(
            f"status to {a.ranks} ranks: {results['status']:.2f} s, goal <= 3 s: {'met' if goal else 'NOT met'}; "
            f"ratio to one rank: {results['status'] / results['one rank: status']:.1f}x"
        )
    finally:
        stop_groups(procs)
        shutil.rmtree(rt, ignore_errors=True)


if __name__ == "__main__":
    main()
