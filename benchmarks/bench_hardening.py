"""What queries cost a training process, now that DuckDB runs in the client.

    python benchmarks/bench_hardening.py [--seconds 3] [--clients 20] [--repeat 11] [--baseline DIR] [--no-pin]

Starts a small probed torch training loop (a few hundred steps/s on a CPU) that prints its
step rate, median and worst step time every half second, and a second probed process that
only idles (the control). Then, side by side in one run:

1. step-rate ratio of the training loop while N client threads issue small queries over the
   unix socket (snapshot + DuckDB in the client, as the CLI does), against the same load
   aimed at the idle control process (goal >= 0.9 with 20 clients); and while N threads ask
   for raw snapshots back to back (no DuckDB: what N clients on a many-core node can ask, or
   a runaway script), which ``PROBE_SERVE_SHARE`` paces;
2. the training process's RSS during hostile queries (huge lists and strings, a large
   snapshot) against its RSS before (goal: bounded by PROBE_SNAPSHOT_BYTES);
3. the first-query stall, on a fresh loop of ~15 ms steps (``--stall-width``): the worst step
   while the first query of the process runs, against the median step (goal <= 2x) and the worst
   steps of quiet windows (the machine's own noise);
4. CLI latencies (process start included): `probe PID query` as a table and as JSON, `probe PID
   backtrace`, and `py-spy dump` for the same process (goal: query <= 0.45 s median);
5. the same query from a client whose DuckDB is already loaded, as the REPL, the page and the
   MCP server run it (goal <= 50 ms median).

On a machine with two CPUs or more, item 1 pins the training loop(s) to CPU 0 and the clients
and the control process to the other CPUs, so that the ratio measures what answering costs the
training process (its server threads, the GIL) and not the clients' own CPU competing with it
for two cores; ``--no-pin`` measures the shared layout (both figures are worth knowing: on a
real node the CLI runs beside the job, on CPUs the job usually leaves to its data loaders).

With ``--against NAME=VALUE`` (default ``PROBE_SERVE_SHARE=off``) item 1 also runs a loop of
this probe with that setting, in the same interleaved rounds.

With ``--baseline DIR`` (a checkout or ``git archive`` of an older probe), item 1 also runs a
second training loop that imports the probe from DIR, in the same interleaved rounds (the loop
not being measured is stopped with SIGSTOP), so before and after are measured side by side.
"""

from __future__ import annotations

import argparse
import os
import shutil
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

PROBE = (
    str(Path(sys.executable).with_name("probe"))
    if Path(sys.executable).with_name("probe").exists()
    else shutil.which("probe")
)

TRAIN = r"""
import os, sys, time, statistics
import torch
import probe.auto  # noqa: F401
torch.set_num_threads(1)
w = int(os.environ.get("BENCH_WIDTH", "256"))
model = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
                            torch.nn.Linear(w, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(128, w), torch.randn(128, 1)
print(f"ready {os.getpid()}", flush=True)
window, last, n = [], time.perf_counter(), 0
while True:
    t0 = time.perf_counter()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    t1 = time.perf_counter()
    window.append(t1 - t0)
    n += 1
    if t1 - last >= 0.5:
        print(f"stats {n / (t1 - last):.1f} {statistics.median(window) * 1e3:.3f} {max(window) * 1e3:.3f}", flush=True)
        window, last, n = [], t1, 0
"""

IDLE = r"""
import os, time
import torch  # noqa: F401  (the same tables as the training process)
import probe.auto  # noqa: F401
print(f"ready {os.getpid()}", flush=True)
while True:
    time.sleep(1)  # ok-sleep: the control process only idles
"""


class Proc:
    def __init__(self, code: str, env: dict, cpus: set | None = None):
        self.p = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        if cpus:
            os.sched_setaffinity(self.p.pid, cpus)  # before it starts its threads: they inherit it
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self.ready.wait(120):
            raise SystemExit("a benchmark process did not start:\n" + "\n".join(self.lines))
        self.pid = self.p.pid

    def _pump(self):
        for line in self.p.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("ready"):
                self.ready.set()

    def stats_since(self, index: int) -> list[tuple[float, float, float]]:
        out = []
        for line in self.lines[index:]:
            if line.startswith("stats "):
                rate, med, worst = map(float, line.split()[1:4])
                out.append((rate, med, worst))
        return out

    def rss(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(5)
        except subprocess.TimeoutExpired:
            self.p.kill()


def wait_stats(proc: Proc, seconds: float) -> list:
    start = len(proc.lines)
    time.sleep(seconds)  # ok-sleep: the measurement window
    return proc.stats_since(start)


class Session:
    """What the CLI's query path needs of a session, for one local pid (the REPL and UI keep one like it)."""

    timeout = 10.0
    multi = False
    format = "json"
    args = None

    def __init__(self, pid: int):
        from probe.cli.plumbing.endpoint import resolve

        self._target = resolve(str(pid))

    def client(self, target=None):
        from probe.cli.plumbing.client import Client

        return Client(target or self._target, timeout=self.timeout)

    def target(self):
        return self._target

    def targets(self):
        return [self._target]

    def print(self, text=""):
        pass

    def note(self, text):
        pass


def small_query_load(pid: int, clients: int, stop: threading.Event, counts: list, errors: list) -> list:
    """``clients`` threads each running small queries the way the CLI does: snapshot, then DuckDB here."""
    from probe.cli.query_runner import federated_query

    def worker(i):
        s = Session(pid)
        while not stop.is_set():
            try:
                federated_query(
                    s, f"SELECT {i} AS i, count(*) AS n, max(step) AS last FROM torch.steps", targets=[s.target()]
                )
                counts[i] += 1
            except Exception as exc:  # counted, shown at the end
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    return threads


def raw_snapshot_load(pid: int, clients: int, stop: threading.Event, counts: list, errors: list) -> list:
    """``clients`` threads asking for the small query's snapshot back to back, with no work of their own."""
    from probe.cli.plumbing.client import Client
    from probe.cli.plumbing.endpoint import resolve

    target = resolve(str(pid))

    def worker(i):
        c = Client(target, timeout=10)
        while not stop.is_set():
            try:
                c.snapshot({"torch.steps": {"columns": ["step"]}}, 10)
                counts[i] += 1
            except Exception as exc:  # counted, shown at the end
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    return threads


def cli_median(env, args, repeat) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = subprocess.run(args, capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - t0)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=11)
    ap.add_argument("--baseline", help="directory of another probe (its training side) to measure item 1 against")
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for the probed processes (this probe's, not the baseline's), e.g. PROBE_SERVE_SHARE=off",
    )
    ap.add_argument(
        "--against",
        default="PROBE_SERVE_SHARE=off",
        metavar="NAME=VALUE",
        help="item 1 also runs a loop of this probe with this setting, side by side (default: pacing off); '' for none",
    )
    ap.add_argument("--no-pin", action="store_true", help="let the training loop and the clients share every CPU")
    ap.add_argument(
        "--stall-width",
        type=int,
        default=1024,
        help="hidden width of item 3's loop (1024: ~10-15 ms steps on a 2-core VM)",
    )
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and len(cpus) >= 2
    train_cpus, client_cpus = ({cpus[0]}, set(cpus[1:])) if pin else (None, None)
    if pin:
        os.sched_setaffinity(0, client_cpus)  # the clients (threads of this process) and their DuckDB threads
    print(
        "layout: "
        + (
            f"training on CPU {cpus[0]}, clients and the control process on CPU(s) {','.join(map(str, cpus[1:]))}"
            if pin
            else f"everything shares CPUs {','.join(map(str, cpus))}"
        )
    )
    rt = tempfile.mkdtemp(prefix="pbh-", dir="/tmp")
    env = clean_env(rt)  # no PROBE* setting of ours, its own runtime dir, unbuffered, one OpenMP thread
    os.environ.update(PROBE_RUNTIME_DIR=rt)
    settings = dict(kv.split("=", 1) for kv in args.env)
    train = Proc(TRAIN, dict(env, **settings), train_cpus)
    idle = Proc(IDLE, env, client_cpus)
    base = Proc(TRAIN, dict(env, PYTHONPATH=args.baseline), train_cpus) if args.baseline else None
    against = (
        Proc(TRAIN, dict(env, **settings, **dict([args.against.split("=", 1)])), train_cpus) if args.against else None
    )
    loops = {
        "this probe": train,
        **({f"with {args.against}": against} if against else {}),
        **({"baseline": base} if base else {}),
    }

    def only(proc):
        """Let ``proc`` run and stop the other training loop (one measured at a time)."""
        for other in loops.values():
            os.kill(other.pid, signal.SIGCONT if other is proc else signal.SIGSTOP)

    stall = None
    try:
        # 3. first-query stall, on a loop of ~15 ms steps (the size where it was first measured) that no query has
        #    touched yet: the worst step of the window the first query lands in, against the median step and the
        #    worst steps of quiet windows of the same length (this machine's own scheduling noise)
        for other in loops.values():
            os.kill(other.pid, signal.SIGSTOP)
        stall = Proc(TRAIN, dict(env, **settings, BENCH_WIDTH=str(args.stall_width)), train_cpus)
        wait_stats(stall, 2.0)  # warm up

        def worst_during(fn, seconds=1.5):
            start = len(stall.lines)
            fn()
            time.sleep(seconds)  # ok-sleep: let the stats lines covering the window come out
            stats = stall.stats_since(start)
            return max(s[2] for s in stats), statistics.median(s[1] for s in stats)

        def one_query():
            r = subprocess.run(
                [PROBE, str(stall.pid), "query", "SELECT count(*) FROM torch.steps", "-f", "json"],
                capture_output=True,
                text=True,
                env=env,
            )
            assert r.returncode == 0, r.stderr

        quiet = [worst_during(lambda: time.sleep(0.5)) for _ in range(3)]  # ok-sleep: windows without a query
        median_step = statistics.median(m for _, m in quiet)
        first, _ = worst_during(one_query)
        later, _ = worst_during(one_query)
        stall.stop()
        quiet_worst = max(w for w, _ in quiet)
        print(
            f"3. first query ({args.stall_width}-wide loop): worst step {first:.1f} ms; a later query {later:.1f} ms; "
            f"median step {median_step:.2f} ms; worst step of 3 quiet windows {quiet_worst:.1f} ms   "
            f"first/median {first / median_step:.2f}x (goal <= 2x), first/quiet {first / quiet_worst:.2f}x"
        )

        only(train)
        wait_stats(train, 2.0)  # warm up
        # 1. step rate under small-query load, aimed at the training process vs at the control, in
        #    interleaved rounds (alone, control, training) so that the machine's drift cancels out
        arms = (
            ("control", idle, small_query_load),
            ("training", None, small_query_load),
            ("raw", None, raw_snapshot_load),
        )
        ratios: dict = {name: {arm[0]: [] for arm in arms} for name in loops}
        done: dict = {name: dict.fromkeys(ratios[name], 0) for name in loops}
        failures: list = []
        for _ in range(args.rounds):
            for name, loop in loops.items():
                only(loop)
                for label, proc, load in arms:
                    alone = statistics.median(s[0] for s in wait_stats(loop, args.seconds))
                    stop, counts, errors = threading.Event(), [0] * args.clients, []
                    threads = load((proc or loop).pid, args.clients, stop, counts, errors)
                    loaded = statistics.median(s[0] for s in wait_stats(loop, args.seconds))
                    stop.set()
                    for t in threads:
                        t.join(30)
                    ratios[name][label].append(loaded / alone)
                    done[name][label] += sum(counts)
                    failures += errors
        only(train)
        for name in loops:
            r = {label: statistics.median(v) for label, v in ratios[name].items()}
            q = {label: n / (args.rounds * args.seconds) for label, n in done[name].items()}
            print(
                f"1. {name}: {args.clients} clients, median of {args.rounds} rounds "
                "(each against its own window alone just before): "
                f"step-rate ratio {r['training']:.2f} with CLI-like queries to the training process "
                f"({q['training']:.0f}/s; goal >= 0.9), "
                f"{r['control']:.2f} with them aimed at another process ({q['control']:.0f}/s; the clients' own CPU), "
                f"{r['raw']:.2f} with raw snapshots back to back ({q['raw']:.0f}/s answered)   "
                f"[{len(failures)} failed" + (f": {failures[0]}" if failures else "") + "]"
            )

        # 2. RSS during hostile queries
        before = train.rss()
        peak = [before]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], train.rss())
                time.sleep(0.01)  # ok-sleep: sampling RSS

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        hostile = [
            "SELECT max(len(x)) FROM (SELECT range(100000000) AS x)",
            "SELECT max(length(s)) FROM (SELECT repeat('x', 1000000) AS s FROM range(500))",
            "SELECT count(*) FROM torch.steps a, torch.steps b, torch.steps c",
            "SELECT * FROM python.torch_trace",
        ]
        outcomes = []
        for sql in hostile:
            t0 = time.perf_counter()
            r = subprocess.run(
                [PROBE, "--timeout", "3", str(train.pid), "query", sql, "-f", "json"],
                capture_output=True,
                text=True,
                env=dict(env, PROBE_QUERY_MEMORY="512MB"),
            )
            outcomes.append(f"{time.perf_counter() - t0:.1f}s rc={r.returncode}")
        done.set()
        sampler.join()
        print(
            f"2. hostile queries ({'; '.join(outcomes)}): training RSS {before / 2**20:.0f} MiB before, "
            f"peak {peak[0] / 2**20:.0f} MiB (+{(peak[0] - before) / 2**20:.1f} MiB; "
            f"goal: bounded by PROBE_SNAPSHOT_BYTES, 64 MB by default)"
        )

        # 4. CLI latencies side by side
        q = "SELECT func, file, lineno, depth FROM python.backtrace WHERE depth < 3"
        table = cli_median(env, [PROBE, str(train.pid), "query", q], args.repeat)
        js = cli_median(env, [PROBE, str(train.pid), "query", q, "-f", "json"], args.repeat)
        bt = cli_median(env, [PROBE, str(train.pid), "backtrace"], args.repeat)
        pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        spy = (
            cli_median(env, [pyspy, "dump", "--pid", str(train.pid)], args.repeat)
            if Path(pyspy).exists()
            else float("nan")
        )
        print(
            f"4. CLI medians of {args.repeat}: query (table) {table:.3f} s (goal <= 0.45 s), query -f json {js:.3f} s, "
            f"backtrace {bt:.3f} s, py-spy dump {spy:.3f} s"
        )

        # 5. a query from a client whose engine is already loaded (the REPL, the page, the MCP server)
        from probe.cli.query_runner import federated_query

        session = Session(train.pid)
        federated_query(session, q, targets=[session.target()])  # warm: imports, schema and plan caches
        warm = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            federated_query(session, q, targets=[session.target()])
            warm.append(time.perf_counter() - t0)
        print(
            f"5. warm query (engine loaded, as in the REPL/UI), median of {args.repeat}: "
            f"{statistics.median(warm) * 1000:.1f} ms (goal <= 50 ms), worst {max(warm) * 1000:.1f} ms"
        )
    finally:
        for proc in (train, idle, base, against, stall):
            if proc is not None and proc.p.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.stop()
        shutil.rmtree(rt, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
