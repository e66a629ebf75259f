"""Ranks in plain DDP (no explicit collective in the loop), from torch's flight recorder: a slow rank,
a collective mismatch, and two jobs on one host (the rank the others wait for, stalled, stopped or
killed, is tests/ranks/test_ranks_culprits.py; both start their jobs with tests/_ranks.py's ``ddp_job``). Every job is
real: gloo on CPU, 3 ranks started with the rendezvous variables; of the two jobs on one host, one is started by
torchrun, as users start them (its launcher is no rank of either job), each known by its own kind of job id.

For each condition, `status` must come to name the rank (PROBE_HUNG_AFTER=2; polled with a deadline, not
timed), and ranks.collectives, ranks.hung and ranks.stragglers must say the same."""

from __future__ import annotations

import json
import shutil
import tempfile
import time

import pytest

from conftest import poll, requires_torch
from _ranks import WITHIN, culprits, ddp_job, states, status, until_status, view

pytestmark = requires_torch


def test_slow_rank_is_the_straggler_by_its_compute_time():
    with ddp_job("--slow-rank", "2", "--slow-compute", "0.15") as job:
        since = time.monotonic()
        # under synchronous DDP every rank has the same step time: only the compute split tells them apart (a step
        # time once a rank has a whole step: step 1 runs from its first module call, and the median leaves it out)
        r, rows = until_status(
            job,
            since,
            lambda rows: (
                states(rows) == {0: "training", 1: "training", 2: "slow"}
                and all(row["step_time"] is not None for row in rows.values())
            ),
        )
        assert r.returncode == 0, r.stderr
        assert rows[2]["reason"].startswith("compute ") and not culprits(rows)
        assert rows[2]["step_time"] == pytest.approx(rows[0]["step_time"], rel=0.5)
        assert rows[0]["wait_share"] > rows[2]["wait_share"]
        stragglers = view(job, "SELECT rank, ratio, basis FROM ranks.stragglers")
        assert [s["rank"] for s in stragglers] == [2] and stragglers[0]["basis"] == "collectives"
        assert stragglers[0]["ratio"] > 1.5
        assert view(job, "SELECT rank FROM ranks.hung") == []
        coll = view(job, "SELECT rank, role, mismatch FROM ranks.collectives")
        assert {c["role"] for c in coll} == {"ok"} and all(c["mismatch"] is None for c in coll)
        # the recorder's rows: DDP's gradient all_reduce, issued from the loop's backward call, one seq per step
        recorded = view(
            job,
            "SELECT op, input_dtypes, state, call_site, count(*) AS n, count(DISTINCT step) AS steps, "
            "max(seq) - min(seq) + 1 AS span FROM torch.collectives WHERE rank = 0 AND step IS NOT NULL "
            "GROUP BY ALL ORDER BY n DESC",
        )
        assert len(recorded) >= 1 and recorded[0]["op"] == "all_reduce" and recorded[0]["input_dtypes"] == "[Float]"
        assert "main (ddp_plain.py:" in recorded[0]["call_site"] and recorded[0]["n"] >= recorded[0]["steps"] > 5
        groups = view(job, "SELECT rank, pg_desc, ranks, last_enqueued FROM torch.process_groups ORDER BY rank")
        assert [g["ranks"] for g in groups] == ["[0, 1, 2]"] * 3 and groups[0]["pg_desc"] == "default_pg"
        steps = view(
            job,
            "SELECT rank, median(compute) AS compute, median(comm_wait) AS wait FROM torch.steps "
            "WHERE compute IS NOT NULL GROUP BY rank ORDER BY rank",
        )
        assert steps[2]["compute"] > 1.5 * steps[0]["compute"] and steps[0]["wait"] > steps[2]["wait"]


def test_extra_all_reduce_on_one_rank_is_a_collective_mismatch():
    with ddp_job("--mismatch-rank", "0", "--mismatch-at", "8", "--step-sleep", "0.1") as job:
        assert poll(lambda: job.saw("mismatch rank=0"), 60)
        since = time.monotonic()
        r, rows = until_status(job, since, lambda rows: (rows[0]["reason"] or "").startswith("collective mismatch"))
        # then: rank 0 issued an int32 all_reduce where the others reduced their float gradients
        said = rows[0]["reason"]
        assert "[Int] here" in said and "[Float] on rank 1" in said and "[Float] on rank 2" in said, said
        assert rows[1]["reason"] is None and rows[2]["reason"] is None
        coll = {c["rank"]: c for c in view(job, "SELECT rank, mismatch FROM ranks.collectives")}
        assert said.endswith(coll[0]["mismatch"]) and coll[1]["mismatch"] is None and coll[2]["mismatch"] is None
        assert view(job, "SELECT rank FROM ranks.hung") == []
        assert 0 not in {s["rank"] for s in view(job, "SELECT rank FROM ranks.stragglers")}
        # and the job goes on (gloo pairs the extra int32 all_reduce with the others' next one, and so on): once the
        # recorder's window has moved past it, the doctor still names rank 0 from the count of collectives each rank
        # had issued at the weight-checksum steps (every 16 steps)
        said = {}

        def named():
            d = job.cli("--ranks", "all", "--format", "json", "doctor")
            said.update(json.loads(d.stdout) if d.stdout.startswith("{") else {"out": d.stdout + d.stderr})
            return [f for f in said.get("findings", []) if f["rule"] == "collectives_out_of_step"]

        found = poll(named, WITHIN, interval=2.0)
        assert found, said
        assert "(rank 0 differs from the others)" in found[0]["message"], found
        assert found[0]["severity"] == "critical" and "rank 0 " in found[0]["message"], found


def test_two_jobs_on_one_host_are_never_mixed():
    rt = tempfile.mkdtemp(prefix="prj-", dir="/tmp")
    try:
        with (
            ddp_job(world=2, rt=rt, wait=False, torchrun=True) as first,
            ddp_job("--slow-rank", "1", "--slow-compute", "0.15", world=2, rt=rt, wait=False) as second,
        ):
            # (both jobs start at once: one start-up's wait, not two)
            assert poll(lambda: first.ready(2) & second.ready(2), 120), "ranks did not get ready:\n" + "\n".join(
                first.lines + second.lines
            )
            since = time.monotonic()
            listed = json.loads(first.cli("list", "--json").stdout)
            jobs = {}
            for row in listed:
                jobs.setdefault(row["job"], set()).add(row["pid"])
            # then: list groups each job's ranks under its own id
            assert sorted(map(sorted, jobs.values())) == sorted(
                [sorted(first.pids.values()), sorted(second.pids.values())]
            )
            assert [r["job"] for r in listed] == sorted(r["job"] for r in listed)
            # --ranks without --job: one sentence, non-zero exit, no mixed answer
            mixed = first.cli("--ranks", "all", "status")
            assert mixed.returncode != 0 and mixed.stdout == ""
            assert "2 jobs" in mixed.stderr and "--job" in mixed.stderr and "Traceback" not in mixed.stderr
            second_id = next(j for j, pids in jobs.items() if pids == set(second.pids.values()))
            r, rows = status(second, "--job", second_id[:8])
            assert r.returncode == 0, r.stderr
            assert {k: v["pid"] for k, v in rows.items()} == second.pids
            # and each job's views speak of its own ranks only: the second job's slow rank is named there, never in
            # the first
            r, rows = until_status(
                second, since, lambda rows: states(rows) == {0: "training", 1: "slow"}, "--job", second_id
            )
            assert {k: v["pid"] for k, v in rows.items()} == second.pids
            assert [s["rank"] for s in view(second, "SELECT rank FROM ranks.stragglers", "--job", second_id)] == [1]
            first_id = next(j for j in jobs if j != second_id)
            assert view(first, "SELECT rank FROM ranks.stragglers", "--job", first_id) == []
            assert view(first, "SELECT rank FROM ranks.hung", "--job", first_id) == []
            bad = first.cli("--job", "nosuchjob", "--ranks", "all", "status")
            assert bad.returncode != 0 and "is not a job" in bad.stderr
    finally:
        shutil.rmtree(rt, ignore_errors=True)
