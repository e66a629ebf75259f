"""Multi-rank jobs for the tests: ``ddp_job`` starts a real probed DDP job (gloo on CPU, each rank started with
the rendezvous variables, or by torchrun), and ``status``, ``view``, ``until_status``, ``states`` and ``culprits``
read it through the real `probe --ranks all` command."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from contextlib import contextmanager

from harness import TARGETS, clean_env, poll, run_probe, share_doctor_plans, start, stop_groups

PARTIAL = 7
HUNG_AFTER = "2"
WITHIN = 90.0  # a deadline for status to give the right answer (a loaded host slows every rank and every call)
TARGET = str(TARGETS / "ddp_plain.py")


class Job:
    def __init__(self, env, procs):
        self.env, self.procs, self.pids = env, procs, {}

    @property
    def lines(self) -> list[str]:
        return [line for p in self.procs for line in p.lines]

    def ready(self, world: int) -> bool:
        for line in list(self.lines):
            for m in re.finditer(r"ready rank=(\d+) pid=(\d+)", line):  # ranks share one pipe
                self.pids[int(m.group(1))] = int(m.group(2))
        for p in self.procs:
            if p.popen.poll() is not None and len(self.pids) < world:
                raise AssertionError("the job exited:\n" + "\n".join(self.lines))
        return len(self.pids) == world

    def saw(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def cli(self, *args, env=None, timeout=60):
        env = dict(self.env, **(env or {}))
        doctor = "doctor" in args
        if doctor:
            share_doctor_plans(env["PROBE_RUNTIME_DIR"], give=True)
        r = run_probe(*args, env=env, timeout=timeout)
        if doctor:
            share_doctor_plans(env["PROBE_RUNTIME_DIR"], give=False)
        return r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def ddp_job(*args, world=3, torchrun=False, rt=None, extra_env=None, target=TARGET, wait=True):
    """A probed job of ``world`` ranks running ``target`` (tests/targets/ddp_plain.py) with ``args`` (and
    ``extra_env``), its ranks ready (``wait=False``: just started; ``job.ready(world)`` says when they are).

    Each rank is its own process with the rendezvous variables (RANK, WORLD_SIZE, MASTER_ADDR:MASTER_PORT), forked
    from the harness's fork server where it can be, and a dead rank does not take the others down with it;
    ``torchrun=True`` starts the job as users do, with ``python -m torch.distributed.run`` (its launcher and every
    rank a fresh interpreter that imports torch: seconds of CPU more a job)."""
    own_rt = rt is None
    rt = rt or tempfile.mkdtemp(prefix="prc-", dir="/tmp")
    env = {
        k: v
        for k, v in clean_env(rt, OMP_NUM_THREADS="1", PROBE_HUNG_AFTER=HUNG_AFTER).items()
        if not k.startswith("TORCH_FR")
    }
    env.update(extra_env or {})
    job_env = dict(env, PROBE="1")
    if not torchrun:
        port = _free_port()
        cmds = [
            (
                [sys.executable, target, *args],
                dict(
                    job_env,
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    RANK=str(r),
                    LOCAL_RANK=str(r),
                    WORLD_SIZE=str(world),
                ),
            )
            for r in range(world)
        ]
    else:
        cmds = [
            (
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc-per-node",
                    str(world),
                    target,
                    *args,
                ],
                job_env,
            )
        ]
    job = Job(env, [])
    try:
        for cmd, e in cmds:
            job.procs.append(start(cmd, e, ready=None))
        assert not wait or poll(lambda: job.ready(world), 120), "ranks did not get ready:\n" + "\n".join(job.lines)
        yield job
    finally:
        for pid in job.pids.values():  # ranks stopped by a test (torchrun's ranks are not group leaders)
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        stop_groups([p.popen for p in job.procs], grace=15)
        if own_rt:
            shutil.rmtree(rt, ignore_errors=True)


def status(job, *extra):
    r = job.cli("--timeout", "5", *extra, "--ranks", "all", "--format", "json", "status")
    try:
        return r, {row["rank"]: row for row in json.loads(r.stdout)}
    except ValueError:
        return r, {}


def view(job, sql, *extra):
    r = job.cli("--timeout", "5", *extra, "--ranks", "all", "--format", "json", "query", sql)
    assert r.returncode in (0, PARTIAL), r.stderr
    return json.loads(r.stdout)


def until_status(job, since: float, predicate, *extra):
    """The first status answer satisfying ``predicate`` within WITHIN s of ``since``, with its delay."""
    last = {}

    def look():
        r, rows = status(job, *extra)
        last.update(r=r, rows=rows)
        return (r, rows) if rows and predicate(rows) else None

    # every second: each `--ranks all status` asks every rank, CPU the job's ranks share
    found = poll(look, max(0.0, since + WITHIN - time.monotonic()), interval=1.0)
    assert found, (
        f"status did not name the rank within {WITHIN} s: {last.get('rows')}\n"
        f"{last.get('r').stderr if last.get('r') else ''}\njob output:\n" + "\n".join(job.lines[-20:])
    )
    return found


def states(rows):
    return {k: v["state"] for k, v in rows.items()}


def culprits(rows):
    return {k for k, v in rows.items() if v["culprit"]}
