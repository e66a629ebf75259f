"""The rates `probe lr` may set: NaN, infinity and a rate that would kill or stall the job are refused (by the CLI and
by the HTTP route) and nothing is queued; a zero or a big jump is applied and the job steps on."""

from __future__ import annotations

import json

import pytest

from conftest import poll, requires_torch, TARGETS
from harness import audit_records, last_step, post, steps_on


@requires_torch
def test_lr_refuses_nan_and_inf(spawn, cli):
    target = spawn(TARGETS / "actions_train.py")
    for value in ("nan", "inf", "-inf", "1e400"):
        r = cli(target.pid, "--yes", "lr", f"--set={value}")
        assert r.returncode != 0 and "finite" in (r.stdout + r.stderr), (value, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
    r = cli(target.pid, "--yes", "lr", "--scale=nan")
    assert r.returncode != 0 and "finite" in (r.stdout + r.stderr)
    # the run is untouched: the LR is still a finite number
    lr = json.loads(cli(target.pid, "query", "SELECT lr FROM torch.optimizer", "-f", "json").stdout)
    assert lr and all(row["lr"] is not None and row["lr"] == row["lr"] for row in lr), lr


ACTIONS = TARGETS / "actions_train.py"


def _lr_actions(cli, pid) -> list:
    r = cli(pid, "query", "SELECT id, state FROM probe.actions WHERE command = 'lr'", "--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def rate_jobs(shared_spawn):
    """One training job per optimizer and dtype (no scheduler: the rate stays 0.05), shared by the refusals: a
    refused rate queues nothing and changes nothing, so each case meets the job as the first one did."""
    jobs: dict = {}

    def job(optim: str, dtype: str):
        if (optim, dtype) not in jobs:
            jobs[optim, dtype] = shared_spawn(
                [ACTIONS, "--sched", "none", "--optim", optim, "--dtype", dtype, "--step-sleep", "0.05"]
            )
        return jobs[optim, dtype]

    return job


@requires_torch
@pytest.mark.parametrize(
    "optim, dtype, argv, words",
    [
        ("Adam", "float32", ["--set", "1e39"], "would overflow its float32 parameters"),
        ("Adam", "float32", ["--set", "1e39", "--force"], "would overflow its float32 parameters"),
        ("SGD", "float32", ["--scale", "1e308"], "would overflow its float32 parameters"),
        ("SGD", "float32", ["--scale", "1e308", "--force"], "would overflow its float32 parameters"),
        ("Adam", "float16", ["--set", "100", "--force"], "would overflow its float16 parameters"),
        ("SGD", "float32", ["--set", "nan"], "must be a finite number"),
        ("SGD", "float32", ["--scale", "inf"], "must be a finite number"),
        ("SGD", "float32", ["--set", "0"], "give --allow-zero"),
        ("SGD", "float32", ["--scale", "0"], "give --allow-zero"),
        ("SGD", "float32", ["--set", "-0.1"], "must not be negative"),
        ("SGD", "float32", ["--set", "5"], "give --force if you mean it"),
    ],
)
def test_a_rate_that_would_kill_or_stall_the_job_is_refused_and_nothing_is_queued(
    rate_jobs, shared_cli, shared_env, optim, dtype, argv, words
):
    # given a training job (no scheduler: the rate stays 0.05), and the audit log so far
    p = rate_jobs(optim, dtype)
    audited = len(audit_records(shared_env))
    # when the CLI asks for the rate
    r = shared_cli(p.pid, "--yes", "lr", *argv)
    # then one sentence, a non-zero exit, nothing queued, a refusal in the audit log, and the job steps on
    assert r.returncode != 0, r.stdout + r.stderr
    assert words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert _lr_actions(shared_cli, p.pid) == []
    refused = [a for a in audit_records(shared_env)[audited:] if a.get("command") == "lr"]
    assert refused and all(a.get("outcome") == "refused" and a.get("pid") in (p.pid, None) for a in refused), refused
    assert steps_on(p, last_step(p)), p.output()[-2000:]


@requires_torch
def test_asked_for_a_zero_or_a_big_jump_is_applied_and_the_jobsteps_on(spawn, cli):
    p = spawn([ACTIONS, "--sched", "none", "--step-sleep", "0.05"])
    r = cli(p.pid, "--yes", "lr", "--set", "2", "--force")
    assert r.returncode == 0 and "0.05 -> 2" in r.stdout, r.stdout + r.stderr
    r = cli(p.pid, "--yes", "lr", "--set", "0", "--allow-zero")
    assert r.returncode == 0 and "2 -> 0" in r.stdout, r.stdout + r.stderr
    assert poll(lambda: any(line.startswith("step ") for line in p.lines)) and steps_on(p, last_step(p))


@requires_torch
def test_the_http_route_refuses_the_same_rates(spawn, cli, probe_env):
    # given the route every tier reaches (the page, MCP and TCP post the same body)
    p = spawn([ACTIONS, "--sched", "none", "--optim", "Adam", "--step-sleep", "0.05"])
    with open(f"{probe_env['PROBE_RUNTIME_DIR']}/{p.pid}.json") as f:
        sock = json.load(f)["socket"]

    for body, words in (
        ({"set": 1e39, "force": True}, "would overflow"),
        ({"scale": 1e308}, "would overflow"),
        ({"set": 0.0}, "--allow-zero"),
        ({"set": 1.0}, "--force"),
        ({"set": "NaN"}, "finite"),
    ):
        status, doc = post(sock, "/actions/lr", json.dumps(body).encode())
        assert 400 <= status < 500 and words in json.dumps(doc), (body, status, doc)
    assert _lr_actions(cli, p.pid) == []
    assert steps_on(p, last_step(p))
