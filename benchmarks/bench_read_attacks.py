"""What readers can take from a training process: its step rate under three read-route attacks, unattacked beside.

    python benchmarks/bench_read_attacks.py [--seconds 2.5] [--rounds 2] [--threads 2000] [--huge-mb 300] [--no-pin]

Starts one small probed torch training loop (a few hundred steps/s on a CPU; it prints its step
rate every half second) that also holds ``--threads`` idle threads and a thread ``holder`` whose
frame keeps a ``--huge-mb`` MB bytes local, listening on TCP behind a token as well as on its unix
socket. Then, for each arm, a fresh such loop (so that no arm pays for another's debt) is attacked
``--rounds`` times for ``--seconds``, each attack between two unattacked windows:

(a) 16 clients holding the token ask for snapshots of ``python.backtrace`` over TCP back to back, while
    the owner asks for a small one over the unix socket twice a second: step rate, and how the owner's
    queries were answered (before separate lanes per listener, the flood spent the owner's share too);
(b) 4 token holders loop ``GET /backtrace`` over TCP (a backtrace of every thread, which was charged to
    nothing and bounded by nothing);
(c) a token holder loops ``backtrace --locals`` of the ``holder`` thread over TCP (its local's repr was built
    whole: hundreds of MB and a stall per request); also the process's peak RSS growth (VmHWM).

An arm with no attack (A/A) shows the run's own noise. Each arm is printed as its median step rate over
the median of the unattacked windows on either side of it, round by round (the host's own load drifts),
with the rounds' spread.
The clients speak raw HTTP and import nothing of the probe's, so the same script measures any probe
version: run it with the interpreter whose ``probe`` is the one to measure (``cd /work/main &&
python PATH/TO/bench_read_attacks.py`` measures main's). On two CPUs or more the training loop is
pinned to CPU 0 and the clients to the others (``--no-pin``: all share).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

TOKEN = "bench-read-attacks-token"

TRAIN = r"""
import os, sys, threading, time, statistics
import torch
import probe.auto  # noqa: F401
torch.set_num_threads(1)

def park(started):
    started.release()
    threading.Event().wait()

def hold(ready, mb):
    big = b"b" * (mb << 20)  # its repr is what `backtrace --locals` shows
    ready.set()
    threading.Event().wait()
    return big

threading.stack_size(256 * 1024)
started, held = threading.Semaphore(0), threading.Event()
n_threads, huge_mb = int(os.environ["BENCH_THREADS"]), int(os.environ["BENCH_HUGE_MB"])
for _ in range(n_threads):
    threading.Thread(target=park, args=(started,), daemon=True).start()
for _ in range(n_threads):
    started.acquire()
threading.Thread(target=hold, args=(held, huge_mb), name="holder", daemon=True).start()
held.wait()
w = 256
model = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, w), torch.randn(64, 1)
print(f"ready {os.getpid()}", flush=True)
last, n = time.perf_counter(), 0
while True:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    n += 1
    t = time.perf_counter()
    if t - last >= 0.5:
        print(f"stats {n / (t - last):.1f}", flush=True)
        last, n = t, 0
"""


def http(where, method: str, path: str, body: bytes = b"", token: str | None = None, timeout: float = 30.0) -> int:
    """The status of one request (0: no answer), reading the answer to its end."""
    try:
        if isinstance(where, str):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            s.connect(where)
        else:
            s = socket.create_connection(where, timeout=timeout)
    except OSError:
        return 0
    try:
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        data = s.recv(1 << 16)
        head = data
        while data:
            data = s.recv(1 << 20)
        return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
    except (OSError, ValueError, IndexError):
        return 0
    finally:
        s.close()


def snapshot_body(table: str, column: str, timeout: float) -> bytes:
    return json.dumps({"tables": {table: {"columns": [column]}}, "timeout": timeout}).encode()


class Target:
    def __init__(self, env: dict, cpus):
        self.p = subprocess.Popen(
            [sys.executable, "-c", TRAIN], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        if cpus:
            os.sched_setaffinity(self.p.pid, cpus)
        self.lines: list[str] = []
        ready = threading.Event()

        def pump():
            for line in self.p.stdout:
                self.lines.append(line.rstrip())
                if line.startswith("ready"):
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(180):
            raise SystemExit("the training loop did not start:\n" + "\n".join(self.lines[-20:]))
        with open(os.path.join(env["PROBE_RUNTIME_DIR"], f"{self.p.pid}.json")) as f:
            entry = json.load(f)
        self.sock, self.tcp = entry["socket"], ("127.0.0.1", entry["tcp_port"])

    def rates_during(self, seconds: float) -> list[float]:
        start = len(self.lines)
        time.sleep(seconds)  # ok-sleep: the measurement window
        return [float(x.split()[1]) for x in self.lines[start:] if x.startswith("stats ")][1:]  # first: mixed

    def peak_mb(self) -> float:
        with open(f"/proc/{self.p.pid}/status") as f:
            return int(next(x for x in f if x.startswith("VmHWM:")).split()[1]) / 1024


def attack(target: Target, arm: str, stop: threading.Event, counts: dict) -> list[threading.Thread]:
    def loop(fn):
        while not stop.is_set():
            status = fn()
            counts[status] = counts.get(status, 0) + 1

    def owner():
        while not stop.is_set():
            status = http(target.sock, "POST", "/snapshot", snapshot_body("torch.steps", "step", 10.0), timeout=15)
            counts[f"owner {status}"] = counts.get(f"owner {status}", 0) + 1
            stop.wait(0.5)  # ok-sleep: the owner's pace, twice a second

    if arm == "-":
        fns, extra = [], []
    elif arm == "a":
        heavy = snapshot_body("python.backtrace", "func", 2.0)  # every frame of every thread
        fns = [lambda: http(target.tcp, "POST", "/snapshot", heavy, TOKEN)] * 16
        extra = [owner]
    elif arm == "b":
        fns, extra = [lambda: http(target.tcp, "GET", "/backtrace?wait=2", token=TOKEN)] * 4, []
    else:
        fns, extra = [lambda: http(target.tcp, "GET", "/backtrace?locals=1&thread=holder&wait=2", token=TOKEN)], []
    threads = [threading.Thread(target=loop, args=(fn,), daemon=True) for fn in fns]
    threads += [threading.Thread(target=fn, daemon=True) for fn in extra]
    for t in threads:
        t.start()
    return threads


ARMS = {
    "-": "nobody (an A/A arm: the run's own noise)",
    "a": "16 TCP token holders flood snapshots (owner queries twice a second)",
    "b": "4 TCP token holders loop backtrace",
    "c": "a TCP token holder loops backtrace --locals of a huge local",
}


def measure_arm(env: dict, cpus, arm: str, args) -> tuple:
    """A fresh training loop (no debt left by another arm), attacked ``args.rounds`` times between unattacked
    windows: (ratio per round, answers by status, peak RSS growth in MB, the unattacked rates)."""
    target = Target(env, cpus)
    ratios: list[float] = []
    counts: dict = {}
    quiet: list[float] = []
    grown = 0.0
    try:
        before = target.rates_during(args.seconds)
        for _ in range(args.rounds):
            stop = threading.Event()
            peak = target.peak_mb()
            threads = attack(target, arm, stop, counts)
            during = target.rates_during(args.seconds)
            stop.set()
            for t in threads:
                t.join(20)
            grown = max(grown, target.peak_mb() - peak)
            after = target.rates_during(args.seconds)
            if during and before + after:
                ratios.append(statistics.median(during) / statistics.median(before + after))
            quiet += before
            before = after
        quiet += before
    finally:
        target.p.terminate()
        try:
            target.p.wait(10)
        except subprocess.TimeoutExpired:
            target.p.kill()
    return ratios, counts, grown, quiet


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=2.5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2000)
    ap.add_argument("--huge-mb", type=int, default=300)
    ap.add_argument("--no-pin", action="store_true")
    args = ap.parse_args()
    import probe  # the probe being measured: the one this interpreter imports

    print(f"probe: {os.path.dirname(probe.__file__)}")
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and len(cpus) >= 2
    if pin:
        os.sched_setaffinity(0, set(cpus[1:]))
    rt = tempfile.mkdtemp(prefix="pba-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE")}
    env.update(
        PROBE_RUNTIME_DIR=rt,
        PROBE_PORT="0",
        PROBE_TOKEN=TOKEN,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        BENCH_THREADS=str(args.threads),
        BENCH_HUGE_MB=str(args.huge_mb),
    )
    train_cpus = {cpus[0]} if pin else None
    quiet: list[float] = []
    try:
        for arm, what in ARMS.items():
            ratios, counts, grown, rates = measure_arm(env, train_cpus, arm, args)
            quiet += rates
            r = sorted(ratios) or [0.0]
            print(
                f"({arm}) {what}: step-rate ratio {statistics.median(r):.2f} (rounds {r[0]:.2f}-{r[-1]:.2f}); "
                f"answers {dict(sorted(counts.items(), key=str))}"
                + (f"; peak RSS growth {grown:.0f} MB" if arm == "c" else ""),
                flush=True,
            )
        print(f"unattacked: {statistics.median(quiet):.0f} steps/s (median of {len(quiet)} half-second windows)")
    finally:
        shutil.rmtree(rt, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
