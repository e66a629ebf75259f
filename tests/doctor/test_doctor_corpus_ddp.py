"""The doctor on distributed errors from public reports (tests/faults/real_world_ddp.py cites each): 2 ranks
on gloo (tests/_ranks.py's ``ddp_job``), several errors per job where they do not interact,
`probe --ranks all doctor` names each with the rule tests/faults/corpus_ddp.py gives, and the healthy twin (the
same script with --fixed: a plain DDP job with no collective of its own in the loop) gets nothing, not even
info, while its ranks' weight checksums agree exactly at the same steps. Each error prints the steps and
seconds from its onset to the doctor naming it (docs/doctor.md has the table). Last, the two rules that
compare ranks, on hand-made tables of three ranks (no job here has three): the rank outside the majority
is named."""

from __future__ import annotations

import json
import re
import time

import pytest
from conftest import ROOT, poll, requires_torch
from faults.corpus_ddp import DDP_ERRORS
from _ranks import ddp_job, view

pytestmark = requires_torch
SCRIPT = str(ROOT / "tests" / "faults" / "real_world_ddp.py")
QUIET = {"PROBE_HUNG_AFTER": "600"}  # ddp_job's default is 2 s: a loaded host pauses a healthy rank that long


def doctor(job) -> list:
    r = job.cli("--timeout", "10", "--ranks", "all", "--format", "json", "doctor", "--all", timeout=120)
    assert r.returncode in (0, 8), r.stderr
    assert "Traceback" not in r.stderr
    return json.loads(r.stdout)["findings"]


def steps(job) -> int:
    r = job.cli("--ranks", "all", "--format", "json", "query", "SELECT max(step) AS step FROM torch.steps")
    return json.loads(r.stdout)[0]["step"] or 0


def onset(job, pattern: str) -> tuple[int, float]:
    """The step and time of the first line matching ``pattern`` (step=S time=T), waited for."""
    found: list = []

    def look():
        found[:] = [m for line in list(job.lines) for m in [re.search(pattern, line)] if m]
        return found

    assert poll(look, 120), "\n".join(job.lines[-20:])
    return int(found[0].group("step")), float(found[0].group("time") or time.time())


def named(job, errors: list, since: tuple[int, float], timeout: float = 120.0) -> dict:
    """Poll the doctor until the rules of ``errors`` have all named them; check each finding and print the steps
    and seconds from ``since`` (the onset) to the doctor run that first named it. The findings, by error."""
    first: dict = {}
    last: list = []

    def look():
        last[:] = doctor(job)
        now = time.time()  # the doctor run that named it has just ended
        new = [e for e in errors if e not in first and any(f["rule"] == DDP_ERRORS[e][0] for f in last)]
        if new:
            n = steps(job) - since[0]
            for error in new:
                first[error] = ([f for f in last if f["rule"] == DDP_ERRORS[error][0]][0], n, now - since[1])
        return len(first) == len(errors)

    # a doctor run a second at most: each one is a doctor run on every rank, CPU the ranks share
    assert poll(look, timeout, interval=1.0), (
        f"named only {sorted(first)} of {errors}:\n" + json.dumps(last, indent=1) + "\n" + "\n".join(job.lines[-20:])
    )
    out = {}
    for error in errors:
        rule, rank, severity, words = DDP_ERRORS[error]
        finding, n, s = first[error]
        print(f"\n{error}: {rule} after {n} steps, {s:.1f} s from onset (at step {since[0]})")
        assert sum(f["rule"] == rule for f in last) == 1, last  # one finding for the job, not one per rank
        assert finding["severity"] == severity and finding["rank"] == rank, finding
        for w in words:
            assert w in finding["message"], finding
        assert finding["next"] and all(n.startswith("probe ") for n in finding["next"]), finding
        out[error] = finding
    return out


@pytest.mark.phases
def test_replicas_that_drift_apart_and_a_ddp_set_up_that_cannot_agree():
    # given: the model called without its DDP wrapper on odd steps from step 40, broadcast_buffers=False with
    # batch norm, find_unused_parameters=True with nothing unused (none of them acts on the others' signal)
    with ddp_job(
        "--error",
        "no_wrapper",
        "--error",
        "buffers",
        "--error",
        "unused",
        "--batches",
        "100000",
        world=2,
        target=SCRIPT,
        extra_env=QUIET,
    ) as job:
        at = onset(job, r"onset rank=\d+ step=(?P<step>\d+) time=(?P<time>[\d.]+)")
        # then: each named by its own rule, the drift with the tensors that differ first
        found = named(job, ["no_wrapper", "buffers", "unused"], at)
        drift = found["no_wrapper"]["evidence"]
        assert drift["since"] > at[0] - 32 and drift["agreed_at"] != "no step compared", (
            drift
        )  # agreed before the onset


@pytest.mark.phases
def test_a_rank_local_change_then_a_rank_whose_data_runs_out():
    # given: rank 0 alone loads a checkpoint of the head at step 40, after wrapping; rank 1's shard has one
    # batch fewer than rank 0's, so at step 200 it reaches the end-of-epoch barrier while rank 0 waits in DDP's
    # collectives of its last batch
    with ddp_job(
        "--error", "rank_local", "--error", "uneven", "--batches", "200", world=2, target=SCRIPT, extra_env=QUIET
    ) as job:
        at = onset(job, r"onset rank=0 step=(?P<step>\d+) time=(?P<time>[\d.]+)")
        local = named(job, ["rank_local"], at)["rank_local"]
        assert local["evidence"]["differ"] == 2, local  # the head alone: DDP averages every gradient since
        # when: rank 1 runs out of batches
        out = onset(job, r"epoch done rank=1 step=(?P<step>\d+)(?P<time>)")
        # then: the rank whose data ran out, long before PROBE_HUNG_AFTER, where it is and where the other waits
        named(job, ["uneven"], out)
        # and once PROBE_HUNG_AFTER has passed too (1 s here), the ranks that complete no step are not a finding
        # each beside it: the mismatch explains them, and says so
        r = job.cli("--ranks", "all", "--format", "json", "doctor", env={"PROBE_HUNG_AFTER": "1"}, timeout=120)
        found = [f for f in json.loads(r.stdout)["findings"] if f["severity"] == "critical"]
        assert [f["rule"] for f in found] == ["collective_mismatch"], found
        assert found[0]["message"].endswith("It explains: hung on ranks 0, 1."), found[0]["message"]
        assert {e["rule"] for e in found[0]["evidence"]["explains"]} == {"hung"}, found[0]["evidence"]


@pytest.mark.phases
@pytest.mark.parametrize("error", ["same_data", "same_data_dropout"])
def test_ranks_fed_the_same_batches(error):
    # given: from step 40 every rank reads the same batch (no DistributedSampler); same_data_dropout: with dropout
    # seeded per rank, so the ranks' losses differ
    with ddp_job("--error", error, "--batches", "100000", world=2, target=SCRIPT, extra_env=QUIET) as job:
        at = onset(job, r"onset rank=\d+ step=(?P<step>\d+) time=(?P<time>[\d.]+)")
        # then: the job, not a rank, is named, from steps since the onset only
        found = named(job, [error], at)[error]
        assert found["evidence"]["first"] >= at[0], found
        if error == "same_data_dropout":  # from the inputs: the losses differ
            assert found["evidence"]["basis"] == "inputs", found
            # and: the ranks' losses differed at every step since the onset that both have
            (row,) = view(
                job,
                "SELECT count(*) AS steps, count(*) FILTER (WHERE losses = 2) AS differ FROM (SELECT step, "
                f"count(DISTINCT loss) AS losses FROM torch.steps WHERE step >= {at[0]} GROUP BY step "
                "HAVING count(*) = 2)",
            )
            assert row["steps"] > 0 and row["differ"] == row["steps"], row


@pytest.mark.phases
def test_the_healthy_twin_a_plain_ddp_job_gets_nothing_and_its_replicas_agree():
    # given: the same script with every error fixed: plain DDP, no collective of its own in the loop (the epoch,
    # and its barrier, never ends), past the onset
    with ddp_job(
        "--fixed",
        "--error",
        "no_wrapper",
        "--error",
        "buffers",
        "--error",
        "unused",
        "--error",
        "rank_local",
        "--error",
        "same_data",
        "--error",
        "same_data_dropout",
        "--error",
        "uneven",
        "--batches",
        "100000",
        world=2,
        target=SCRIPT,
        extra_env=QUIET,
    ) as job:
        at = onset(job, r"onset rank=\d+ step=(?P<step>\d+) time=(?P<time>[\d.]+)")
        assert poll(lambda: steps(job) >= at[0] + 200, 120, interval=1.0), "\n".join(job.lines[-20:])
        # then: not even an info finding
        assert doctor(job) == []
        # and: both ranks took checksums at the same steps, before and after the onset, and every one agrees
        r = job.cli(
            "--ranks",
            "all",
            "--format",
            "json",
            "query",
            "SELECT step, position, count(DISTINCT rank) AS ranks, max(checksum) - min(checksum) AS spread "
            "FROM torch.weight_sums GROUP BY step, position HAVING count(DISTINCT rank) = 2",
        )
        rows = json.loads(r.stdout)
        assert min(row["step"] for row in rows) < at[0] < max(row["step"] for row in rows), rows
        assert all(row["spread"] == 0 for row in rows), [row for row in rows if row["spread"]]


def _sums(rows):
    cols = (
        "rank INTEGER, step BIGINT, time DOUBLE, model VARCHAR, position BIGINT, "
        "name VARCHAR, numel BIGINT, checksum DOUBLE"
    )
    return {"torch.weight_sums": (cols, rows)}


def test_weights_diverged_names_the_rank_outside_the_majority_and_waits_for_every_rank():
    from _doctor import rule_rows

    names = ["enc.0.weight", "enc.0.bias", "head.weight"]

    def at(step, rank, values):
        return [(rank, step, 0.0, "model", i, n, 10, v) for i, (n, v) in enumerate(zip(names, values))]

    # given: 3 ranks agree at step 16; at step 32 rank 2's head differs; rank 1 has not taken step 48's yet
    rows = [r for rank in range(3) for r in at(16, rank, [1.0, 2.0, 3.0])]
    rows += at(32, 0, [1.5, 2.0, 3.5]) + at(32, 1, [1.5, 2.0, 3.5]) + at(32, 2, [1.5, 2.0, 3.25])
    rows += at(48, 0, [1.6, 2.0, 3.6]) + at(48, 2, [1.6, 2.0, 3.1])
    (found,) = rule_rows("weights_diverged", _sums(rows))
    # then: compared at the last step every rank has, naming the tensor and the rank apart from the others
    assert found["step"] == 32 and found["since"] == 32 and found["agreed_at"] == "step 16", found
    assert found["differ"] == 1 and found["tensors"] == 3 and found["modules"] == "head.weight", found
    assert found["who"] == "rank 2 differs from the others", found
    # and: replicas that agree (a float64 rounding apart) are not a finding
    same = [r for rank in range(2) for r in at(16, rank, [1.0, 2.0, 3.0 + rank * 1e-15])]
    assert rule_rows("weights_diverged", _sums(same)) == []


def test_collective_mismatch_names_the_odd_rank_of_three_and_waits_for_the_jobs_pace():
    from _doctor import rule_rows

    def tables(waited):
        steps = [(r, s, 0.01) for r in range(3) for s in range(1, 41)]
        groups = [
            (0, "0", 1, 184, "allreduce", waited, "train (t.py:10)", 184),
            (1, "0", 1, 184, "barrier", waited, "<module> (t.py:20)", 184),
            (2, "0", 1, 184, "allreduce", waited, "train (t.py:10)", 184),
        ]
        return {
            "torch.steps": ("rank INTEGER, step BIGINT, duration DOUBLE", steps),
            "torch.process_groups": (
                "rank INTEGER, pg VARCHAR, pending BIGINT, pending_seq BIGINT, pending_op VARCHAR, "
                "pending_s DOUBLE, pending_site VARCHAR, last_enqueued BIGINT",
                groups,
            ),
            "ranks.latest": ("rank INTEGER, step BIGINT, p99 DOUBLE", [(r, 40, 0.01) for r in range(3)]),
        }

    # given: ranks 0 and 2 in an all_reduce, rank 1 in a barrier, at the same seq, for 6 s (600x the 10 ms steps)
    (found,) = rule_rows("collective_mismatch", tables(6.0), messages=True)
    # then: rank 1, where it issued its barrier and where the others issued theirs
    assert found.startswith(
        "rank 1 left the other ranks' path: at seq 184 of process group 0 it issued barrier at "
        "<module> (t.py:20), where rank 0 issued allreduce at train (t.py:10); rank 2 issued allreduce"
    ), found
    # and: not before 5 s, whatever the pace
    assert rule_rows("collective_mismatch", tables(4.0)) == []
