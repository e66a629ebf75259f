"""The rank the others wait for, in plain DDP (no explicit collective in the loop), from torch's
flight recorder: a rank stalled in its data read, a stopped rank, a killed rank. Every job is real:
gloo on CPU, 3 ranks started with the rendezvous variables by tests/_ranks.py's ``ddp_job`` (a file of its own so that
two xdist workers share the multi-rank jobs).

For each condition, `status` must come to name the rank (PROBE_HUNG_AFTER=2; polled with a deadline, not
timed), and ranks.collectives, ranks.hung and ranks.stragglers must say the same."""

from __future__ import annotations

import os
import signal
import time

from conftest import poll, requires_torch
from _ranks import PARTIAL, culprits, ddp_job, states, until_status, view

pytestmark = requires_torch


def test_stalled_data_read_is_the_culprit_and_the_others_wait_in_the_collective():
    with ddp_job("--stall-rank", "1", "--stall-at", "8") as job:
        assert poll(lambda: job.saw("stalling rank=1"), 60)
        since = time.monotonic()
        # when / then: status names rank 1, the others wait in DDP's all_reduce for it
        r, rows = until_status(job, since, lambda rows: states(rows) == {0: "waiting", 1: "hung", 2: "waiting"})
        assert r.returncode == 0, r.stderr
        assert culprits(rows) == {1}
        assert "ranks 0,2 wait for it" in rows[1]["reason"]
        assert rows[0]["reason"].startswith("waits in all_reduce seq") and rows[0]["reason"].endswith("for rank 1")
        assert "read_batch" in rows[1]["top_frame"]
        # and the views agree
        coll = {row["rank"]: row for row in view(job, "SELECT * FROM ranks.collectives")}
        assert coll[1]["role"] == "culprit" and coll[1]["waited_by"] == "0,2" and coll[1]["behind"] >= 1
        assert coll[0]["role"] == coll[2]["role"] == "waiting" and coll[0]["waits_for"] == "1"
        assert coll[0]["pending_op"] == "all_reduce" and coll[0]["pending_seq"] == coll[1]["last_enqueued"] + 1
        hung = view(job, "SELECT rank, state, culprit FROM ranks.hung")
        assert hung[0] == {"rank": 1, "state": "hung", "culprit": True}
        assert {h["rank"]: h["state"] for h in hung[1:]} == {0: "waiting", 2: "waiting"}
        assert view(job, "SELECT rank FROM ranks.stragglers") == []


def test_stopped_rank_is_hung_and_the_others_wait():
    with ddp_job() as job:
        os.kill(job.pids[1], signal.SIGSTOP)
        since = time.monotonic()
        r, rows = until_status(job, since, lambda rows: states(rows) == {0: "waiting", 1: "hung", 2: "waiting"})
        assert r.returncode == PARTIAL
        assert culprits(rows) == {1} and "process stopped" in rows[1]["reason"]
        assert "stopped" in r.stderr
        coll = {c["rank"]: c for c in view(job, "SELECT rank, role, waits_for FROM ranks.collectives")}
        assert coll[1]["role"] == "culprit" and coll[0]["role"] == "waiting" and "1" in coll[0]["waits_for"].split(",")
        hung = view(job, "SELECT rank, state, culprit FROM ranks.hung")
        assert hung[0] == {"rank": 1, "state": "hung", "culprit": True}
        assert view(job, "SELECT rank FROM ranks.stragglers") == []


def test_killed_rank_is_the_culprit_the_survivors_wait_for():
    with ddp_job("--survive") as job:
        os.kill(job.pids[1], signal.SIGKILL)
        since = time.monotonic()
        r, rows = until_status(job, since, lambda rows: states(rows) == {0: "waiting", 1: "unreachable", 2: "waiting"})
        assert r.returncode == PARTIAL
        assert culprits(rows) == {1} and "ranks 0,2 wait for it" in rows[1]["reason"]
        coll = {c["rank"]: c for c in view(job, "SELECT rank, role FROM ranks.collectives")}
        # a survivor's failed collective may stay unfinished in its recorder (waiting) or not (ok): never the culprit
        assert coll[1]["role"] == "culprit" and {coll[0]["role"], coll[2]["role"]} <= {"ok", "waiting"}
        hung = view(job, "SELECT rank, state, culprit FROM ranks.hung")
        assert hung[0] == {"rank": 1, "state": "unreachable", "culprit": True}
        assert view(job, "SELECT rank FROM ranks.stragglers") == []
