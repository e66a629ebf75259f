"""Start-up of the one-shot `probe` command against `py-spy dump`, side by side.

    python benchmarks/bench_startup.py [--rounds 15] [--no-torch] [--imports]

Starts one small probed process (a tiny torch training loop, or with ``--no-torch`` a plain
Python loop), then runs, in interleaved rounds (each round runs every command once, in a
rotated order, so a busy neighbour slows all of them alike):

- ``py-spy dump --pid PID`` (the baseline: a native binary that reads the stacks itself),
- ``probe PID backtrace``,
- ``probe ENDPOINT query "SELECT 1"`` (ENDPOINT: the process's unix socket), and a query that
  reads a table (``SELECT count(*) FROM python.threads``: a snapshot travels and is decoded),
- ``probe --help``,

and prints, per command, the median wall time (process start included) and the median CPU
time (user + system of the child), and the ratio of each to ``py-spy dump``.
Goals: ``backtrace`` <= 4x ``py-spy dump``; a one-shot ``query`` <= 0.3 s median wall.

With ``--baseline DIR`` (a checkout or ``git archive`` of an older probe), also runs the
three probe commands from DIR and from this checkout the same way (``python -c`` with each
tree assembled on PYTHONPATH, so neither pays the editable install's finder), in the same
rounds: before and after, side by side.

With ``--imports``, also prints the slowest imports (cumulative, ``python -X importtime``) of
``probe PID backtrace`` and of the query, to see what a command pulls in.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from harness import stop_groups  # noqa: E402  (tests/harness.py: the one way to stop what a benchmark started)

PROBE = (
    str(Path(sys.executable).with_name("probe"))
    if Path(sys.executable).with_name("probe").exists()
    else shutil.which("probe")
)


def _pyspy() -> str:
    """The py-spy binary itself: a pyenv shim on PATH is a shell script that would add its own start-up."""
    for cand in (Path(sys.executable).with_name("py-spy"), Path(sys.base_prefix) / "bin" / "py-spy"):
        if cand.exists():
            return str(cand)
    return shutil.which("py-spy") or ""


PYSPY = _pyspy()

TARGET = r"""
import os, sys, time
if os.environ.get("BENCH_TORCH") == "1":
    import torch
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
import probe.auto  # noqa: F401
print(f"ready {os.getpid()}", flush=True)
while True:
    if os.environ.get("BENCH_TORCH") == "1":
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    time.sleep(0.01)  # ok-sleep: a slow, light loop: the benchmark measures the CLI, not the job
"""


def timed(args: list[str], env: dict) -> tuple[float, float]:
    """Wall and CPU (user + system of the child) seconds of one run of ``args``; exits if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({r.returncode}): {r.stderr.decode(errors='replace').strip()}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def assemble(src: Path, dest: Path) -> Path:
    """The package-dir mapping of pyproject (probe, probe.sql, probe.cli, probe.injector) as one importable tree."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(src / "probe", dest / "probe", ignore=skip)
    for sub in ("sql", "cli", "injector"):
        shutil.copytree(src / sub, dest / "probe" / sub, ignore=skip)
    return dest


TABLE_QUERY = "SELECT count(*) AS threads FROM python.threads"
RUN_CLI = "import sys; from probe.cli import main; sys.exit(main())"


def slowest_imports(args: list[str], env: dict, top: int) -> list[tuple[int, str]]:
    r = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, env=env)
    rows = []
    for line in r.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        parts = line.split("|")
        try:
            rows.append((int(parts[1].strip()), parts[2].rstrip()))
        except ValueError:  # the header line
            continue
    return sorted(rows, reverse=True)[:top]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15, help="Interleaved rounds (each runs every command once).")
    ap.add_argument("--no-torch", action="store_true", help="A plain Python target (no torch import).")
    ap.add_argument("--imports", action="store_true", help="Also print the slowest imports of backtrace and query.")
    ap.add_argument(
        "--baseline", metavar="DIR", type=Path, help="An older probe checkout to compare with, side by side."
    )
    a = ap.parse_args()
    if not PROBE:
        raise SystemExit("no `probe` command next to this python or on PATH: install the project first.")
    rt = tempfile.mkdtemp(prefix="pbs-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed probe has its bytecode cached: measure that, not compile()
    env.update(
        PROBE_RUNTIME_DIR=rt,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPYCACHEPREFIX=os.path.join(rt, "pycache"),  # written by the warm-up run, never into the checkout
        BENCH_TORCH="0" if a.no_torch else "1",
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", TARGET], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("ready"):
            raise SystemExit(f"the target did not start: {line!r}")
        pid = proc.pid
        sock = next(iter(Path(rt).rglob(f"{pid}.sock")), None)
        endpoint = str(sock) if sock else str(pid)
        cases = [
            ("probe --help", [PROBE, "--help"]),
            ("probe PID backtrace", [PROBE, str(pid), "backtrace"]),
            ("probe SOCK query", [PROBE, endpoint, "query", "SELECT 1"]),
            ("probe SOCK query table", [PROBE, endpoint, "query", TABLE_QUERY]),
        ]
        if PYSPY:
            cases.insert(0, ("py-spy dump --pid", [PYSPY, "dump", "--pid", str(pid)]))
        else:
            print("py-spy not found: no baseline, ratios omitted")
        trees = {}
        if a.baseline:
            trees = {
                "before": assemble(a.baseline.resolve(), Path(rt) / "before"),
                "after": assemble(ROOT, Path(rt) / "after"),
            }
            for label in trees:
                for what, args in (
                    ("--help", ["--help"]),
                    ("backtrace", [str(pid), "backtrace"]),
                    ("query", [endpoint, "query", "SELECT 1"]),
                    ("query table", [endpoint, "query", TABLE_QUERY]),
                ):
                    cases.append((f"{label}: {what}", [sys.executable, "-c", RUN_CLI, *args]))

        def env_of(name):
            label = name.split(":")[0]
            return dict(env, PYTHONPATH=str(trees[label])) if label in trees else env

        for name, args in cases:  # warm the page cache and write the bytecode caches once
            timed(args, env_of(name))
        walls: dict[str, list[float]] = {name: [] for name, _ in cases}
        cpus: dict[str, list[float]] = {name: [] for name, _ in cases}
        for r in range(a.rounds):
            order = cases[r % len(cases) :] + cases[: r % len(cases)]
            for name, args in order:
                w, c = timed(args, env_of(name))
                walls[name].append(w)
                cpus[name].append(c)
        base = statistics.median(walls["py-spy dump --pid"]) if "py-spy dump --pid" in walls else None
        print(
            f"target: {'plain Python' if a.no_torch else 'torch loop'}, pid {pid}; {a.rounds} interleaved rounds, "
            f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; endpoint {endpoint}"
        )
        print(f"{'command':<22} {'wall':>9} {'cpu':>9} {'vs py-spy':>10}")
        for name, _ in cases:
            w, c = statistics.median(walls[name]), statistics.median(cpus[name])
            ratio = f"{w / base:>9.1f}x" if base else f"{'-':>10}"
            print(f"{name:<22} {w * 1e3:>7.0f}ms {c * 1e3:>7.0f}ms {ratio}")
        bt, q = statistics.median(walls["probe PID backtrace"]), statistics.median(walls["probe SOCK query"])
        if base:
            cbase = statistics.median(cpus["py-spy dump --pid"])
            cbt = statistics.median(cpus["probe PID backtrace"])
            print(
                f"goal backtrace <= 4x py-spy dump: {bt / base:.1f}x wall {'ok' if bt <= 4 * base else 'OVER'}, "
                f"{cbt / cbase:.1f}x cpu (a loaded host inflates wall times; cpu times less so)"
            )
        print(f"goal query <= 0.3 s median: {q:.3f} s {'ok' if q <= 0.3 else 'OVER'}")
        if a.imports:
            for name, args in [c for c in cases if c[0].startswith(("probe PID", "probe SOCK"))]:
                print(f"\nslowest imports of `{name}` (cumulative us):")
                for us, mod in slowest_imports([PROBE, *args[1:]], env, 15):
                    print(f"  {us:>8} {mod}")
    finally:
        stop_groups([proc])
        shutil.rmtree(rt, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
