"""Post-mortem records: a process that died still says how, and what its last steps were.

Real processes die for real: an exception in the loop, one in a worker thread, a native
crash (SIGSEGV), SIGKILL after some steps (only the periodic snapshot can speak for it),
and a normal exit. Each is then listed by `probe list --dead`, and its record is a
folder anyone can read without probe (JSON + numpy's .npz).
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import sys
import time

import numpy as np
import pytest

from conftest import TARGETS, poll, requires_torch


def dead(cli, pid, timeout=60.0):
    """Poll `probe list --dead --json` until ``pid`` is there; its row."""
    deadline = time.monotonic() + timeout
    while True:
        r = cli("list", "--dead", "--json")
        assert r.returncode == 0, r.stderr
        rows = [row for row in json.loads(r.stdout) if row["pid"] == pid]
        if rows or time.monotonic() > deadline:
            assert rows, f"pid {pid} not listed as dead: {r.stdout}"
            return rows[0]
        time.sleep(0.2)  # ok-sleep: polling with a deadline


def steps_of(record: str) -> np.ndarray:
    with np.load(os.path.join(record, "tables.npz")) as z:
        assert "python.backtrace/func" in z.files and "process.info/pid" in z.files
        return z["torch.steps/step"]


@requires_torch
@pytest.mark.parametrize("how, cause, words", [
    ("exception", "exception", ["RuntimeError: loss exploded at step 30", "dies.py"]),
    ("thread", "interrupted", ["KeyboardInterrupt", "thread data-prefetch died of RuntimeError: CUDA out of memory"]),
    ("exit", "exit", ["exited normally"]),
])
def test_a_death_leaves_a_record(spawn, cli, probe_env, how, cause, words):
    # given / when: a job that dies (or, for a thread, loses a worker) at step 30
    job = spawn([TARGETS / "dies.py", "--how", how, "--steps", "30"], ready="ready")
    if how == "thread":
        job.wait_for("CUDA out of memory")
        job.popen.send_signal(signal.SIGINT)  # then the job is stopped by hand: its record keeps the thread's death
    job.popen.wait(60)
    # then
    row = dead(cli, job.pid)
    assert row["cause"] == cause, row
    for w in words:
        assert w in row["what"], row
    assert row["last_step"] >= 30
    steps = steps_of(row["record"])
    assert steps.max() >= 30 and len(steps) >= 30
    meta = json.load(open(os.path.join(row["record"], "meta.json")))
    assert any(t["is_main"] for t in meta["stacks"])
    assert stat.S_IMODE(os.stat(row["record"]).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(row["record"], "tables.npz")).st_mode) == 0o600


@requires_torch
def test_sigkill_leaves_the_last_periodic_snapshot(spawn, cli, probe_env):
    job = spawn([TARGETS / "dies.py", "--how", "wait", "--steps", "30"], env={"PROBE_POSTMORTEM_EVERY": "0.3"})
    deadline = time.monotonic() + 60
    while not os.path.isdir(os.path.join(probe_env["PROBE_RUNTIME_DIR"], "postmortem", str(job.pid))):
        assert time.monotonic() < deadline, "no periodic snapshot was written"
        time.sleep(0.1)  # ok-sleep: polling with a deadline
    os.kill(job.pid, signal.SIGKILL)
    job.popen.wait(10)
    row = dead(cli, job.pid)
    assert row["cause"] == "killed" and "SIGKILL" in row["what"], row
    assert row["last_step"] >= 30


@requires_torch
def test_a_native_crash_is_reported_from_the_fatal_signal_dump(spawn, cli):
    job = spawn([TARGETS / "dies.py", "--how", "segv", "--steps", "30"], env={"PROBE_POSTMORTEM_EVERY": "0.3"})
    job.popen.wait(60)
    assert job.popen.returncode == -signal.SIGSEGV
    row = dead(cli, job.pid)
    assert row["cause"] == "fatal_signal" and "Segmentation fault" in row["what"], row


def test_records_are_bounded(spawn, cli):
    pids = []
    for _ in range(3):
        p = spawn([sys.executable, "-c", "import probe.auto"], env={"PROBE_POSTMORTEM_KEEP": "2"}, ready=None)
        assert p.popen.wait(60) == 0, p.output()
        pids.append(p.pid)
    r = cli("list", "--dead", "--json")
    listed = [row["pid"] for row in json.loads(r.stdout)]
    assert listed == [pids[2], pids[1]], (listed, pids)  # newest first, the oldest removed


@requires_torch
def test_a_killed_rank_is_dead_in_status_and_the_doctor_names_it():
    # given: a 3-rank DDP job whose survivors stay alive when a peer dies (each rank its own process:
    # torchrun would tear the others down), with a fast periodic snapshot
    from test_ranks_collectives import ddp_job, states, until_status

    with ddp_job("--survive", direct=True, extra_env={"PROBE_POSTMORTEM_EVERY": "0.3"}) as job:
        rt = job.env["PROBE_RUNTIME_DIR"]
        assert poll(lambda: os.path.isdir(os.path.join(rt, "postmortem", str(job.pids[1]))), 60), "no snapshot of rank 1"
        # when: rank 1 is killed without warning while the others train with it
        os.kill(job.pids[1], signal.SIGKILL)
        # then: status shows it dead (how, at which step), the culprit the others wait for
        r, rows = until_status(job, time.monotonic(), lambda rows: states(rows) == {0: "waiting", 1: "dead", 2: "waiting"})
        assert r.returncode == 0, r.stderr
        dead_row = rows[1]
        assert dead_row["culprit"] and dead_row["pid"] == job.pids[1] and dead_row["step"] >= 1, dead_row
        assert dead_row["reason"].startswith(f"died at step {dead_row['step']} (killed)"), dead_row
        assert "ranks 0,2 wait for it" in dead_row["reason"], dead_row
        # the doctor names it, with how it died and who waits
        d = job.cli("--timeout", "5", "--ranks", "all", "--format", "json", "doctor")
        assert d.returncode == 8, d.stderr
        died = [f for f in json.loads(d.stdout)["findings"] if f["rule"] == "rank_died"]
        assert len(died) == 1 and died[0]["rank"] == 1, d.stdout
        assert died[0]["message"].startswith(f"rank 1 died at step {dead_row['step']} (killed)"), died
        waiting = re.search(r"; ranks ([\d,]+) wait for it", died[0]["message"])
        assert waiting and set(waiting.group(1).split(",")) <= {"0", "2"}, d.stdout
        assert not [f for f in json.loads(d.stdout)["findings"] if f["rule"] == "hung_rank"], d.stdout
        # --ranks all query has its rows, and says where they come from
        q = job.cli("--ranks", "all", "--format", "json", "query",
                    "SELECT i.rank, i.source, i.state, max(s.step) AS last FROM process.info i JOIN torch.steps s "
                    "ON s.rank = i.rank GROUP BY ALL ORDER BY i.rank")
        assert q.returncode == 0, q.stderr
        got = {row["rank"]: row for row in json.loads(q.stdout)}
        assert [got[r]["source"] for r in (0, 1, 2)] == ["live", "postmortem", "live"], got
        assert got[1]["state"] == "dead" and got[1]["last"] == dead_row["step"], got
        # and --rank 1 reads its record like any rank
        bt = job.cli("--rank", "1", "backtrace")
        assert bt.returncode == 0 and "post-mortem record" in bt.stdout and "ddp_plain.py" in bt.stdout, bt.stdout + bt.stderr
