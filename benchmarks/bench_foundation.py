"""Foundation figures, measured side by side in one run on the same machine.

1. `probe PID backtrace` wall time vs `py-spy dump --pid PID` on the same target (goal <= 4x).
2. Import time and RSS added by `import probe.auto` vs a bare interpreter (goal <= 150 ms, <= 20 MB).
3. CPU used by an idle process over 10 s with the probe vs without (goal ~0 extra).

Usage: python benchmarks/bench_foundation.py [--runs 15] [--idle-seconds 10]
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
from harness import clean_env  # noqa: E402  (tests/harness.py: the one harness tests and benchmarks share)

TARGET = ROOT / "tests" / "targets" / "idle.py"
PROBE = (
    str(Path(sys.executable).with_name("probe"))
    if Path(sys.executable).with_name("probe").exists()
    else shutil.which("probe")
)
PYSPY = (
    str(Path(sys.executable).with_name("py-spy"))
    if Path(sys.executable).with_name("py-spy").exists()
    else shutil.which("py-spy")
)


def start(env, with_probe=True):
    e = dict(env)
    if not with_probe:
        e["TARGET_NO_PROBE"] = "1"
    p = subprocess.Popen([sys.executable, str(TARGET)], stdout=subprocess.PIPE, text=True, env=e)
    p.stdout.readline()
    return p


def timed(cmd, env) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, env=env)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed: {r.stderr.decode()[:300]}")
    return dt


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def import_cost(env, runs: int):
    code = (
        "import time, os\n"
        "def rss(): return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
        "r0 = rss(); t0 = time.perf_counter()\n"
        "{stmt}\n"
        "print(time.perf_counter() - t0, rss() - r0)\n"
    )
    out = {}
    for label, stmt in (("bare", "pass"), ("probe.auto", "import probe.auto")):
        samples = [
            subprocess.run(
                [sys.executable, "-c", code.format(stmt=stmt)], capture_output=True, text=True, env=env
            ).stdout.split()
            for _ in range(runs)
        ]
        out[label] = (statistics.median(float(s[0]) for s in samples), statistics.median(int(s[1]) for s in samples))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    args = ap.parse_args()
    rt = tempfile.mkdtemp(prefix="pr-bench-")
    env = clean_env(rt)  # no PROBE* setting of ours, its own runtime dir, unbuffered, one OpenMP thread

    print(f"# probe foundation benchmark ({args.runs} runs each, medians)")
    target = start(env)
    try:
        pid = str(target.pid)
        timed([PROBE, pid, "backtrace"], env)  # warm caches
        probe_t, spy_t, floor_t = [], [], []
        for _ in range(args.runs):  # interleaved so all three see the same machine noise
            probe_t.append(timed([PROBE, pid, "backtrace"], env))
            spy_t.append(timed([PYSPY, "dump", "--pid", pid], env))
            floor_t.append(timed([sys.executable, "-c", "pass"], env))
        p, s, f = statistics.median(probe_t), statistics.median(spy_t), statistics.median(floor_t)
        print(f"backtrace: probe {p * 1000:.0f} ms vs py-spy dump {s * 1000:.0f} ms -> ratio {p / s:.2f}x (goal <= 4x)")
        print(
            f"  floor: a bare `python -c pass` takes {f * 1000:.0f} ms here ({f / s:.2f}x py-spy); "
            f"probe's own work on top of the interpreter start: {(p - f) * 1000:.0f} ms"
        )
    finally:
        target.terminate()
        target.wait()

    costs = import_cost(env, args.runs)
    dt = costs["probe.auto"][0] - costs["bare"][0]
    drss = costs["probe.auto"][1] - costs["bare"][1]
    print(f"import probe.auto: +{dt * 1000:.1f} ms, +{drss / 2**20:.1f} MiB RSS (goals <= 150 ms, <= 20 MB)")

    with_probe, without = start(env), start(env, with_probe=False)
    try:
        c0 = (cpu_seconds(with_probe.pid), cpu_seconds(without.pid))
        time.sleep(args.idle_seconds)
        c1 = (cpu_seconds(with_probe.pid), cpu_seconds(without.pid))
        a, b = c1[0] - c0[0], c1[1] - c0[1]
        print(
            f"idle CPU over {args.idle_seconds:g} s: with probe {a * 1000:.0f} ms, without {b * 1000:.0f} ms "
            f"-> probe adds {(a - b) * 1000:+.0f} ms ({(a - b) / args.idle_seconds * 100:+.2f}% of a core; goal ~0)"
        )
    finally:
        for p in (with_probe, without):
            p.terminate()
            p.wait()
    shutil.rmtree(rt, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
