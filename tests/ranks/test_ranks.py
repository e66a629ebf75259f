"""--ranks against a real `PROBE=1 torchrun --nproc-per-node 4` DDP job (gloo, CPU), and against
plain probed processes for a rank killed with SIGKILL. One torchrun job serves the module; the
test that freezes a rank runs last."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys

import pytest

from conftest import EXAMPLES, TARGETS, poll, requires_torch
from harness import clean_env, run_probe, start, stop_groups

PARTIAL = 7


def run_cli(env, *args, timeout=60):
    return run_probe(*args, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def ddp():
    env = clean_env(prefix="prk-", OMP_NUM_THREADS="1")
    rt = env["PROBE_RUNTIME_DIR"]
    job_env = dict(env, PROBE="1")
    # this interpreter's torchrun: a `torchrun` on PATH may run another installation of probe
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(EXAMPLES / "train_ddp.py"),
        "--steps",
        "0",
        "--step-sleep",
        "0.02",
        "--slow-rank",
        "2",
        "--slow-sleep",
        "0.25",
    ]
    job = start(cmd, job_env, ready=None)
    p, lines = job.popen, job.lines
    pids = {}

    def ready():
        for line in lines:  # ranks share one pipe: two ready lines can land on one line
            for m in re.finditer(r"ready rank=(\d+) pid=(\d+)", line):
                pids[int(m.group(1))] = int(m.group(2))
        if p.poll() is not None:
            raise AssertionError("torchrun exited:\n" + "\n".join(lines))
        return len(pids) == 4

    try:
        assert poll(ready, 120), "ranks did not get ready:\n" + "\n".join(lines)
        yield env, pids
    finally:
        stop_groups([p], grace=15)  # SIGCONT first: a test stops a rank
        shutil.rmtree(rt, ignore_errors=True)


@requires_torch
def test_backtrace_and_tables_across_ranks(ddp):
    env, pids = ddp
    # when
    per_rank = run_cli(env, "--ranks", "all", "backtrace")
    # a backtrace is one instant: on a loaded machine the waiting ranks may be caught in backward
    # instead of the all_reduce, so sample a few times (with a deadline) for the typical picture
    expected = ("ranks 0-1,3: in all_reduce", "rank 2: in load_batch")

    def grouped_view():
        r = run_cli(env, "--ranks", "all", "backtrace", "--group")
        return r if r.returncode != 0 or all(e in r.stdout for e in expected) else None

    grouped = poll(grouped_view, 30) or run_cli(env, "--ranks", "all", "backtrace", "--group")
    tables = run_cli(env, "--ranks", "0-3", "--format", "json", "tables")
    # then: a section per rank, and the slow rank stands alone when stacks are merged
    assert per_rank.returncode == 0, per_rank.stderr
    for rank, pid in pids.items():
        assert f"=== rank {rank} · pid {pid}" in per_rank.stdout
    assert grouped.returncode == 0, grouped.stderr
    assert expected[0] in grouped.stdout, grouped.stdout
    assert expected[1] in grouped.stdout, grouped.stdout
    listed = {t["name"]: t["ranks"] for t in json.loads(tables.stdout)}
    assert listed["torch.steps"] == "all" and listed["process.info"] == "all"


@requires_torch
def test_cross_rank_join_and_straggler(ddp):
    env, pids = ddp
    # when: step times of rank 0 and rank 3 side by side
    joined = poll(
        lambda: (lambda r: r if r.returncode == 0 and len(json.loads(r.stdout)) >= 3 else None)(
            run_cli(
                env,
                "--ranks",
                "all",
                "--format",
                "json",
                "query",
                "SELECT a.step, a.duration AS r0, b.duration AS r3 FROM torch.steps a JOIN torch.steps b "
                "ON a.step = b.step AND b.rank = 3 WHERE a.rank = 0 ORDER BY a.step DESC LIMIT 3",
            )
        )
    )
    assert joined, "the cross-rank join returned no rows"
    rows = json.loads(joined.stdout)
    assert all(r["r0"] > 0 and r["r3"] > 0 for r in rows)
    info = json.loads(
        run_cli(
            env, "--ranks", "all", "--format", "json", "query", "SELECT rank, pid FROM process.info ORDER BY rank"
        ).stdout
    )
    assert {r["rank"]: r["pid"] for r in info} == pids
    # then: status names rank 2 slow (its compute before the step's last collective is longest), the others train
    status = run_cli(env, "--ranks", "all", "--format", "json", "status")
    assert status.returncode == 0, status.stderr
    states = {r["rank"]: r["state"] for r in json.loads(status.stdout)}
    assert states == {0: "training", 1: "training", 2: "slow", 3: "training"}, status.stdout


@requires_torch
def test_actions_fan_out(ddp, tmp_path):
    env, pids = ddp
    # when: an LR change on every rank, confirmed, at the same step
    lr = run_cli(env, "--ranks", "all", "--yes", "lr", "--scale", "0.5", timeout=90)
    assert lr.returncode == 0, lr.stdout + lr.stderr
    got = json.loads(
        run_cli(
            env, "--ranks", "all", "--format", "json", "query", "SELECT rank, lr FROM torch.optimizer ORDER BY rank"
        ).stdout
    )
    assert len(got) == 4 and len({round(r["lr"], 8) for r in got}) == 1 and got[0]["lr"] == pytest.approx(0.005)
    ev = run_cli(env, "--ranks", "0,3", "--yes", "eval", "import os; os.getpid()", timeout=90)
    assert ev.returncode == 0, ev.stdout + ev.stderr
    assert str(pids[0]) in ev.stdout and str(pids[3]) in ev.stdout
    ck = run_cli(env, "--ranks", "all", "--yes", "checkpoint", str(tmp_path / "ck-{rank}.pt"), timeout=120)
    assert ck.returncode == 0, ck.stdout + ck.stderr
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".pt")) == [f"ck-{r}.pt" for r in range(4)]
    cl = run_cli(env, "--ranks", "all", "--yes", "cleanup", timeout=90)
    assert cl.returncode == 0, cl.stdout + cl.stderr


@requires_torch
def test_stopped_rank_is_hung_and_others_wait(ddp):
    env, pids = ddp
    # given: rank 1 frozen
    os.kill(pids[1], signal.SIGSTOP)
    try:

        def look():
            r = run_cli(env, "--timeout", "3", "--ranks", "all", "--format", "json", "status", "--hung-after", "1")
            states = {row["rank"]: row for row in json.loads(r.stdout)}
            ok = states[1]["state"] == "hung" and all(states[k]["state"] == "waiting" for k in (0, 2, 3))
            return (r, states) if ok else None

        found = poll(look, 30, interval=0.5)  # each `--ranks all status` asks all four ranks
        # then: the frozen rank is hung, the others wait inside the collective
        assert found, "status never showed rank 1 hung and the others waiting"
        r, states = found
        assert r.returncode == PARTIAL
        assert "stopped" in states[1]["top_frame"] and "all_reduce" in states[0]["top_frame"]
        hung = run_cli(
            dict(env, PROBE_HUNG_AFTER="1"),
            "--timeout",
            "3",
            "--ranks",
            "all",
            "--format",
            "json",
            "query",
            "SELECT rank, state, in_collective FROM ranks.hung",
        )
        assert hung.returncode == PARTIAL, hung.stderr
        rows = json.loads(hung.stdout)
        assert rows[0] == {"rank": 1, "state": "hung", "in_collective": None}
        assert {r["rank"] for r in rows[1:] if r["in_collective"]} == {0, 2, 3}
        assert "rank 1: process" in hung.stderr and "stopped" in hung.stderr
    finally:
        os.kill(pids[1], signal.SIGCONT)


def test_killed_rank_is_unreachable_and_the_rest_answer(probe_env, spawn, cli):
    # given: three probed processes of a job of world size 3
    procs = [spawn(TARGETS / "idle.py", env={"RANK": str(r), "WORLD_SIZE": "3"}) for r in range(3)]
    ok = cli("--ranks", "all", "--format", "json", "query", "SELECT rank, pid FROM process.info")
    assert ok.returncode == 0, ok.stderr
    # when: rank 1 is killed
    procs[1].popen.send_signal(signal.SIGKILL)
    procs[1].popen.wait(10)
    q = cli("--ranks", "all", "--format", "json", "query", "SELECT rank, pid FROM process.info ORDER BY rank")
    bt = cli("--ranks", "all", "backtrace", "--group")
    errors = cli("--ranks", "all", "--format", "json", "query", "SELECT rank, error FROM ranks.errors")
    # then: the others answer, rank 1 is named, and the exit code says the result is partial
    assert q.returncode == PARTIAL, q.stderr
    assert [r["rank"] for r in json.loads(q.stdout)] == [0, 2]
    assert "rank 1" in q.stderr
    assert bt.returncode == PARTIAL and "rank 1: unreachable" in bt.stdout
    assert [r["rank"] for r in json.loads(errors.stdout)] == [1]
    # and when every rank is gone, the answer is an error, not an empty table
    for p in (procs[0], procs[2]):
        p.popen.kill()
        p.popen.wait(10)
    gone = cli("--ranks", "0,2", "query", "SELECT 1")
    assert gone.returncode == 3 and "Traceback" not in gone.stderr


def test_bad_rank_spec_is_one_sentence(cli):
    r = cli("--ranks", "3-1", "status")
    assert r.returncode == 3
    assert r.stderr.startswith("probe: '3-1' is not a rank list") and "Traceback" not in r.stderr
