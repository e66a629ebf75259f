"""`probe --ranks all doctor` on plain DDP (no explicit collective in the loop, gloo on CPU, 3 ranks
started with the rendezvous variables): one job whose rank 1 is the odd one out.

Rank 1 reads a corrupt shard (targets unrelated to its inputs) and waits 0.15 s more in its data
read every step: the doctor must name it as the straggler and as the rank whose loss is far from
the others'. Then the test makes rank 1 stop in its data read, before its backward, while ranks 0
and 2 wait in DDP's all_reduce: the doctor must name rank 1 as the one the others wait for, where
it is, and not report the waiting ranks as hung; first against the job's own pace (stalled_rank, seconds
after the stall), then after PROBE_HUNG_AFTER (hung_rank). The findings are also a table, across ranks.
Ranks in step (DDP synchronises every step) are never `desync`, the slow rank included.

Then a job whose script forgot DDP: two probed plain loops (tests/targets/faults.py) started as ranks
0 and 1 of one job (RANK, LOCAL_RANK, WORLD_SIZE, one TORCHELASTIC_RUN_ID) with no process group,
rank 1 about 15x slower a step: nothing holds it to rank 0, so it falls hundreds of steps behind.
"""

from __future__ import annotations

import json

from types import SimpleNamespace

from conftest import TARGETS, poll, requires_torch
from _ranks import PARTIAL, ddp_job

pytestmark = requires_torch

FOUND = 8  # probe doctor's exit code when something is wrong


def doctor(job, hung_after: str) -> list:
    r = job.cli(
        "--timeout",
        "10",
        "--ranks",
        "all",
        "--format",
        "json",
        "doctor",
        env={"PROBE_HUNG_AFTER": hung_after},
        timeout=120,
    )
    assert r.returncode in (0, FOUND), r.stderr
    assert "Traceback" not in r.stderr
    return json.loads(r.stdout)["findings"]


def until(job, hung_after: str, wanted, timeout: float = 120.0) -> list:
    """Run the doctor until ``wanted(findings)`` holds; the findings."""
    last: list = []

    def look():
        last[:] = doctor(job, hung_after)
        return wanted(last)

    # every 2 s: each `--ranks all doctor` costs every rank a doctor run, CPU the job's ranks share
    assert poll(look, timeout, interval=2.0), (
        "the doctor never said it:\n" + json.dumps(last, indent=1) + "\njob output:\n" + "\n".join(job.lines[-20:])
    )
    return last


def named(findings, rule):
    return [f for f in findings if f["rule"] == rule]


def test_the_doctor_names_the_odd_rank_of_a_plain_ddp_job(tmp_path):
    stall = tmp_path / "stall"
    with ddp_job(
        "--slow-rank",
        "1",
        "--slow-data",
        "0.15",
        "--bad-data-rank",
        "1",
        "--stall-rank",
        "1",
        "--stall-when",
        str(stall),
        world=3,
    ) as job:
        # given: rank 1 slower in its data read and on a corrupt shard (no hang yet: a long PROBE_HUNG_AFTER)
        findings = until(job, "60", lambda fs: named(fs, "straggler") and named(fs, "loss_dispersion"))
        # then: rank 1, with the numbers
        (slow,) = named(findings, "straggler")
        assert slow["rank"] == 1 and slow["severity"] == "warning", slow
        assert "rank 1 is a straggler" in slow["message"] and slow["evidence"]["basis"] == "collectives", slow
        assert slow["evidence"]["ratio"] > 2, slow  # 0.15 s more per step than ~0.03 s: several times the others
        (apart,) = named(findings, "loss_dispersion")
        assert apart["rank"] == 1 and "rank 1's loss averages" in apart["message"], apart
        assert apart["evidence"]["ratio"] > 3, apart
        assert not [f for f in findings if f["family"] == "distributed" and f["rank"] != 1], findings
        assert not [f for f in findings if f["severity"] == "critical"], findings
        assert not named(findings, "desync"), findings  # slower, but DDP keeps it in step
        # and: the same findings are a table, queryable across ranks like any other
        r = job.cli(
            "--ranks",
            "all",
            "--format",
            "json",
            "query",
            "SELECT rank, rule, severity FROM diagnosis.findings WHERE family = 'distributed' ORDER BY rule",
            env={"PROBE_HUNG_AFTER": "60"},
            timeout=120,
        )
        assert r.returncode in (0, PARTIAL), r.stderr
        rows = json.loads(r.stdout)
        assert {(row["rank"], row["rule"]) for row in rows} >= {(1, "loss_dispersion"), (1, "straggler")}, rows

        # when: rank 1 stops in its data read (before its backward); ranks 0 and 2 wait in DDP's all_reduce
        stall.touch()
        assert poll(lambda: job.saw("stalling rank=1"), 60), "\n".join(job.lines[-20:])
        # then, long before PROBE_HUNG_AFTER: the flight recorder against the job's own pace names rank 1
        findings = until(job, "600", lambda fs: named(fs, "stalled_rank"))
        (stalled,) = named(findings, "stalled_rank")
        assert stalled["rank"] == 1 and stalled["severity"] == "critical", stalled
        assert "ranks 0,2 have waited" in stalled["message"] and "which rank 1 has not issued" in stalled["message"], (
            stalled
        )
        assert "read_batch (ddp_plain.py:" in stalled["message"], stalled
        assert not named(findings, "hung_rank") and not named(findings, "hung"), findings
        assert not named(findings, "stalled"), findings  # the ranks waiting in the collective are no news of their own
        # and once PROBE_HUNG_AFTER has passed, hung_rank says it (and stalled_rank no longer repeats it)
        findings = until(job, "3", lambda fs: named(fs, "hung_rank"))
        assert not named(findings, "stalled_rank"), findings
        # then: rank 1 is the culprit, where it stopped and who waits for it; the waiting ranks are no news of their own
        (culprit,) = named(findings, "hung_rank")
        assert culprit["rank"] == 1 and culprit["severity"] == "critical", culprit
        assert "ranks 0,2 wait for it" in culprit["message"] and "read_batch (ddp_plain.py:" in culprit["message"], (
            culprit
        )
        assert culprit["next"][0] == "probe --rank 1 backtrace", culprit
        assert not named(findings, "hung"), findings
        assert not named(findings, "desync"), findings  # stopped mid-step: the others wait at the same step
        assert findings[0]["rule"] == "hung_rank", findings


def test_the_doctor_names_the_rank_that_falls_behind_in_a_job_without_ddp(spawn, cli):
    # given: ranks 0 and 1 of one job that never synchronise (no process group), rank 1 ~15x slower a step
    job_env = {"PROBE": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "no-ddp"}
    ranks = [
        spawn(
            [TARGETS / "faults.py", "--step-sleep", sleep],
            ready="ready",
            timeout=120,
            env=dict(job_env, RANK=str(r), LOCAL_RANK=str(r)),
        )
        for r, sleep in ((0, "0.005"), (1, "0.1"))
    ]
    job = SimpleNamespace(cli=cli, lines=[line for p in ranks for line in p.lines])
    # when: rank 1 is far behind (hundreds of steps: no snapshot timing explains that)
    findings = until(job, "60", lambda fs: [f for f in named(fs, "desync") if f["evidence"]["behind"] >= 200])
    # then: rank 1, where it is, how far behind, and where the leader is
    (behind,) = named(findings, "desync")
    ev = behind["evidence"]
    assert behind["rank"] == 1 and behind["severity"] == "warning", behind
    assert ev["lead_step"] == ev["step"] + ev["behind"] and ev["lead_step"] > 2 * ev["step"], behind
    assert behind["message"].startswith(
        f"rank 1 is at step {ev['step']}, {ev['behind']} step(s) behind "
        f"the most advanced rank (at step {ev['lead_step']})"
    ), behind
    assert behind["next"] == ["probe --ranks all status", "probe --rank 1 backtrace"], behind
    assert not [f for f in findings if f["family"] == "distributed" and f["rank"] != 1], findings
