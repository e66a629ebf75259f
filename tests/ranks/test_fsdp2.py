"""FSDP2 (``fully_shard``) on gloo, 2 ranks under ``python -m torch.distributed.run``, PROBE=1 at its
defaults and no probe code: the job trains while queries and ``--ranks all doctor`` run (until the test lets it
finish), and the flight recorder shows only the job's own collectives (the probe never issues one: a
collective on one rank that the other never matches hangs the job). Gradient norms are per rank
(the local shards), torch.parameters reads the local shards, torch.optimizer counts this rank's."""

from __future__ import annotations

import json

from conftest import TARGETS, poll, requires_torch
from _ranks import ddp_job

pytestmark = requires_torch

TARGET = str(TARGETS / "fsdp2_train.py")
STEPS = 200  # the least each rank trains: a history for torch.steps and the doctor


def rows(job, sql, *extra):
    r = job.cli("--ranks", "all", "--format", "json", *extra, "query", sql)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_fsdp2_trains_at_defaults_while_probed_and_probe_issues_no_collective(tmp_path):
    ckpt = str(tmp_path / "ck-{rank}.pt")
    stop = tmp_path / "stop"
    # the job trains on past its STEPS until the test, done with its round of queries, makes the file ``stop``; 10 ms
    # of sleep a step keep its two ranks from taking both cores from the queries
    with ddp_job(
        "--steps",
        str(STEPS),
        "--until",
        str(stop),
        "--step-sleep",
        "0.01",
        "--linger",
        world=2,
        target=TARGET,
        extra_env={"PROBE_HUNG_AFTER": "30"},
        torchrun=True,
    ) as job:
        # when: a checkpoint of the sharded model, then queries and a doctor call while the job trains (each reads
        # every rank)
        c = job.cli("--ranks", "all", "--yes", "checkpoint", ckpt)
        assert c.returncode == 0, c.stdout + c.stderr
        for r in (0, 1):
            assert f"the file holds rank {r}'s shards of 2" in c.stdout and "probe.load_checkpoint(" in c.stdout, (
                c.stdout
            )
        steps = rows(job, "SELECT rank, MAX(step) AS step, COUNT(grad_norm) AS norms FROM torch.steps GROUP BY rank")
        assert len(steps) == 2, steps
        params = rows(
            job, "SELECT rank, name, numel, local_numel, placement, grad_norm, nan_count FROM torch.parameters"
        )
        assert {p["rank"] for p in params} == {0, 1} and all(p["placement"] for p in params), params
        # values are read at a step boundary: every rank is still stepping, so none is NULL
        assert all(p["nan_count"] == 0 for p in params), (
            "a rank had no step boundary within 5 s while training",
            rows(job, "SELECT rank, MAX(step) AS step, MAX(ended_at) AS at FROM torch.steps GROUP BY rank"),
            job.lines[-6:],
            params[:4],
        )
        d = job.cli("--ranks", "all", "--format", "json", "doctor")
        doc = json.loads(d.stdout)
        assert doc["answering"] == 2, d.stdout + d.stderr
        found = doc["findings"]
        assert not [f for f in found if f["rule"] in ("hung_rank", "desync", "not_answering")], found
        assert not job.saw("done rank="), "the job finished before the test let it"
        # then: both ranks go on to their last step together (no hang), with the probe busy up to then
        stop.touch()
        assert poll(lambda: job.saw("done rank=0 ") and job.saw("done rank=1 "), 600), "\n".join(job.lines[-20:])
        done = sorted(line for line in job.lines if line.startswith("done rank="))
        assert done[0].split()[-1] == done[1].split()[-1], done
        # and the flight recorder holds the job's collectives only: forward and backward of the
        # training loop, the same ones on both ranks
        coll = rows(job, "SELECT rank, op, call_site, COUNT(*) AS n FROM torch.collectives GROUP BY ALL")
        assert coll and {c["rank"] for c in coll} == {0, 1}, coll
        assert all(c["call_site"].startswith("<module> (fsdp2_train.py:") for c in coll), coll  # none "probe: ..."
        per_rank = [sorted((c["op"], c["call_site"], c["n"]) for c in coll if c["rank"] == r) for r in (0, 1)]
        assert per_rank[0] == per_rank[1], per_rank
        # gradient norms are this rank's shards', measured on both ranks
        norms = rows(job, "SELECT rank, COUNT(grad_norm) AS n FROM torch.steps GROUP BY rank ORDER BY rank")
        assert [n["n"] > 0 for n in norms] == [True, True], norms
        # parameters: the whole shape, this rank's shard, read without a collective
        params = rows(
            job, "SELECT rank, SUM(numel) AS numel, SUM(local_numel) AS local FROM torch.parameters GROUP BY rank"
        )
        assert all(p["local"] < p["numel"] for p in params), params
        # the optimizer counts this rank's shards: together, the model's elements once
        opt = rows(job, "SELECT rank, elements, state_bytes FROM torch.optimizer")
        assert sum(o["elements"] for o in opt) == params[0]["numel"], (opt, params)
        assert all(o["state_bytes"] > 0 for o in opt), opt
        errors = rows(job, "SELECT rank, source, message FROM probe.errors")
        assert not errors, errors

    # and each rank's file loads on its rank of a job sharded the same way, with probe.load_checkpoint
    with ddp_job("--steps", "1", "--resume", ckpt, world=2, target=TARGET) as again:
        assert poll(lambda: again.saw("done rank=0") and again.saw("done rank=1"), 120), "\n".join(again.lines)
        resumed = sorted(line for line in again.lines if line.startswith("resumed"))
        # both shards from one step: the checkpoint ran at the same step on both ranks
        step = resumed[0].split("step=")[1].split()[0] if resumed else None
        assert resumed == [
            f"resumed rank={r} step={step} sharded=S(0) local=(16, 16) of=(32, 16) match=True" for r in (0, 1)
        ], again.lines
