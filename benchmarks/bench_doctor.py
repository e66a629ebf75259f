"""What `probe doctor` costs, and that it does not cry wolf on a healthy job, in one run (CPU).

    python benchmarks/bench_doctor.py [--seconds 60] [--world 3] [--faults | --faults-only]

1. A healthy job (examples/train_gpt.py) trains for ``--seconds``; the doctor runs on it
   back to back the whole time. Every run's wall time is kept, and every finding above info
   is printed: there must be none (exit code 1 otherwise). Goal: one rank in <= 5 s.
2. A healthy local DDP job (examples/train_ddp.py --step-sleep 0, ``--world`` ranks on gloo, started with
   ``python -m torch.distributed.run``): the doctor across all ranks and on rank 0 alone,
   alternating, so that their ratio is measured under the same load. Goal: all ranks in <= 10 s.

3. Side by side (``--side-by-side`` runs only this): the healthy train_gpt.py and the ``--world``-rank DDP job
   train flat out at the same time (``--world`` + 1 training processes on this host's cores: a harder load
   than either alone), and the doctor alternates between the one process and all the ranks, each with the
   rules' plans cached from the run before (``sql/plan_cache.py``, the normal case) and with the cache
   removed first (a first run). Goals: one process <= 5 s, all ranks <= 10 s.

4. With ``--faults``: every planted fault of tests/targets/faults.py (the table the tests
   assert on, tests/targets/fault_catalog.py), one job at a time: how long after the job
   says the fault is planted the doctor first names it, that finding's first line, and one
   doctor run's wall time. ``--faults-only`` skips 1 and 2.

Timings depend on the machine's load (the CLI, DuckDB and the ranks share its cores): the
script prints the load average beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from harness import clean_env  # noqa: E402  (tests/harness.py: the one harness tests and benchmarks share)

PROBE = str(Path(sys.executable).with_name("probe"))


def start(cmd: list, env: dict, pattern: str, count: int = 1, timeout: float = 180.0):
    """Start ``cmd``; wait for ``count`` lines matching ``pattern``; (process, the matches, output lines)."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        cwd=env["PROBE_RUNTIME_DIR"],
    )
    lines: list = []
    threading.Thread(target=lambda: [lines.append(line.rstrip()) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        found = [m for line in list(lines) for m in re.finditer(pattern, line)]
        if len(found) >= count:
            return proc, found, lines
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise SystemExit("the job did not get ready:\n" + "\n".join(lines[-20:]))
        time.sleep(0.2)  # ok-sleep: polling for the ready line with a deadline


def stop(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
    except (OSError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass


CPU: list = []  # CPU seconds (user + system) of each doctor run: its own cost, whatever the machine's load


def doctor(env: dict, *where) -> tuple[float, dict]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(
        [PROBE, *where, "--format", "json", "doctor"], capture_output=True, text=True, env=env, timeout=120
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    if r.returncode not in (0, 8):
        raise SystemExit(f"probe doctor failed ({r.returncode}): {r.stderr}")
    return wall, json.loads(r.stdout)


def loud(doc: dict) -> list:
    return [f for f in doc["findings"] if f["severity"] in ("critical", "warning")]


def summary(times: list, cpu: list) -> str:
    return (
        f"wall median {statistics.median(times):.2f} s, max {max(times):.2f} s over {len(times)} runs; "
        f"CPU of the CLI median {statistics.median(cpu):.2f} s"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--faults", action="store_true", help="also time the doctor on every planted fault")
    ap.add_argument("--faults-only", action="store_true", help="only the planted faults")
    ap.add_argument("--side-by-side", action="store_true", help="only the two jobs at once, the doctor alternating")
    args = ap.parse_args()
    rt = tempfile.mkdtemp(prefix="pr-doctor-", dir="/tmp")
    env = clean_env(rt)  # no PROBE* setting of ours, its own runtime dir, unbuffered, one OpenMP thread
    wolf = []
    if args.side_by_side:
        return side_by_side(env, rt, args.world, args.pairs)
    if args.faults or args.faults_only:
        planted_faults(env)
        if args.faults_only:
            return 0

    # 1. one healthy job for a minute, the doctor back to back
    if args.seconds > 0:
        wolf += healthy_minute(env, args.seconds)

    # 2. a healthy local DDP job (no simulated data wait: --step-sleep 0), all ranks vs rank 0, alternating
    ddp = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.world),
        str(ROOT / "examples" / "train_ddp.py"),
        "--steps",
        "0",
        "--step-sleep",
        "0",
    ]
    proc, _, _ = start(ddp, dict(env, PROBE="1"), r"ready rank=(\d+)", count=args.world)
    try:
        every, one, cpu_every, cpu_one = [], [], [], []
        for _ in range(args.pairs):
            wall, doc = doctor(env, "--ranks", "all")
            every.append(wall)
            cpu_every.append(CPU[-1])
            wolf += [("train_ddp, all ranks", f) for f in loud(doc)]
            if doc["answering"] != args.world:
                raise SystemExit(f"only {doc['answering']} of {args.world} ranks answered the doctor")
            wall, doc = doctor(env, "--rank", "0")
            one.append(wall)
            cpu_one.append(CPU[-1])
        ratio = statistics.median(a / b for a, b in zip(every, one))
        print(f"healthy train_ddp.py --step-sleep 0, {args.world} ranks:")
        print(f"  doctor, all ranks: {summary(every, cpu_every)} (goal <= 10 s)")
        print(f"  doctor, rank 0:    {summary(one, cpu_one)}")
        print(
            f"  all ranks / one rank, paired runs: median wall ratio {ratio:.2f}; load average {os.getloadavg()[0]:.1f}"
        )
    finally:
        stop(proc)
    for where, f in wolf:
        print(f"CRIED WOLF ({where}): {f['severity']} {f['rule']}: {f['message']}")
    return 1 if wolf else 0


def side_by_side(env: dict, rt: str, world: int, pairs: int) -> int:
    """train_gpt.py and a ``world``-rank DDP job flat out at once; the doctor on each, alternating, with the
    plan cache warm and cold. Returns 1 when a finding above info came up (a healthy job)."""
    one, found, _ = start(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--print-every", "1000000"], env, r"ready pid=(\d+)"
    )
    ddp = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        str(ROOT / "examples" / "train_ddp.py"),
        "--steps",
        "0",
        "--step-sleep",
        "0",
    ]
    wolf, times = [], {}
    try:
        job, _, _ = start(ddp, dict(env, PROBE="1"), r"ready rank=(\d+)", count=world)
        try:
            pid = found[0].group(1)
            cache = os.path.join(rt, "doctor-plans.json")
            for _ in range(pairs):
                for cold in (False, True):
                    for label, where in (("one process", (pid,)), (f"{world} ranks", ("--ranks", "all"))):
                        if cold and os.path.exists(cache):
                            os.unlink(cache)
                        wall, doc = doctor(env, *where)
                        key = (label, "cold" if cold else "warm")
                        times.setdefault(key, []).append((wall, CPU[-1], os.getloadavg()[0]))
                        wolf += [(label, f) for f in loud(doc)]
        finally:
            stop(job)
    finally:
        stop(one)
    print(
        f"side by side: train_gpt.py and train_ddp.py x{world} flat out at once on {os.cpu_count()} CPUs; "
        f"the doctor alternating, {pairs} runs each:"
    )
    print("| | plans | wall, median (max) | CPU of the CLI, median | load average, median |")
    print("|---|---|---|---|---|")
    for (label, plans), rows in times.items():
        walls = [w for w, _, _ in rows]
        print(
            f"| {label} | {plans} | {statistics.median(walls):.2f} s ({max(walls):.2f} s) | "
            f"{statistics.median(c for _, c, _ in rows):.2f} s | {statistics.median(load for _, _, load in rows):.1f} |"
        )
    for where, f in wolf:
        print(f"CRIED WOLF ({where}): {f['severity']} {f['rule']}: {f['message']}")
    return 1 if wolf else 0


def planted_faults(env: dict) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "targets"))
    from fault_catalog import FAULTS, plant

    print("planted fault -> the doctor's first finding (seconds from 'planted' to named; one doctor run's wall time):")
    for fault, rule, _ in FAULTS:
        extra, settings = plant(fault)
        proc, _, _ = start(
            [sys.executable, str(ROOT / "tests" / "targets" / "faults.py"), *extra], dict(env, **settings), r"planted"
        )
        try:
            t0 = time.perf_counter()
            while True:
                wall, doc = doctor(env, str(proc.pid))
                hit = [f for f in doc["findings"] if f["rule"] == rule]
                if hit or time.perf_counter() - t0 > 90:
                    break
            first = doc["findings"][0] if doc["findings"] else None
            named = f"named after {time.perf_counter() - t0:.1f} s" if hit else "NOT NAMED within 90 s"
            line = (
                f"{first['severity']} {first['rule']}: {first['message'].splitlines()[0]}" if first else "(no finding)"
            )
            print(f"  {fault}: {named}; doctor {wall:.2f} s; first: {line}")
        finally:
            stop(proc)


def healthy_minute(env: dict, seconds: float) -> list:
    """examples/train_gpt.py for ``seconds``, the doctor back to back; the findings above info."""
    wolf = []
    proc, found, _ = start(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--print-every", "50"], env, r"ready pid=(\d+)"
    )
    pid = found[0].group(1)
    try:
        times, runs = [], 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            wall, doc = doctor(env, pid)
            times.append(wall)
            runs += 1
            wolf += [(f"train_gpt after {seconds - (end - time.monotonic()):.0f} s", f) for f in loud(doc)]
        steps = subprocess.run(
            [PROBE, pid, "--format", "json", "query", "SELECT max(step) AS step FROM torch.steps"],
            capture_output=True,
            text=True,
            env=env,
        ).stdout
        print(
            f"healthy train_gpt.py for {seconds:.0f} s ({json.loads(steps)[0]['step']} steps): "
            f"{runs} doctor runs, {len(wolf)} findings above info"
        )
        print(f"  doctor, one rank: {summary(times, CPU[-runs:])} (goal <= 5 s); load average {os.getloadavg()[0]:.1f}")
    finally:
        stop(proc)
    return wolf


if __name__ == "__main__":
    sys.exit(main())
