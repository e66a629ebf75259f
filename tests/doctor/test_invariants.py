"""The invariant checks of training (torch.checks, probe/training/invariants.py) hold on healthy jobs of the
frameworks users run (HF Trainer with gradient accumulation, Lightning, the examples' GPT with dropout), with
PROBE=1 and no probe code: every check made is ok and the doctor says nothing above info (the rules that read the
host's load, tests/_doctor.py HOST_FAMILIES, have their own healthy controls). The planted
violations (a missing zero_grad, zero_grad between backward and step, eval mode left on) are in the fault
catalog (tests/targets/fault_catalog.py), each named by its rule."""

from __future__ import annotations

import importlib.util
import json

import pytest

from _doctor import above_info, doctor
from conftest import EXAMPLES, TARGETS, poll, requires_torch

pytestmark = requires_torch

# paced (10 ms a step): the checks come with measured steps, which the budget takes at about the same pace whether
# the loop sleeps or not, and a loop stepping flat out takes a core for as long as the test waits for them
JOBS = {
    "hf_accum": ([TARGETS / "hf_trainer.py", "--accum", "2", "--step-sleep", "0.01"], "transformers"),
    "lightning": ([TARGETS / "lightning_train.py", "--step-sleep", "0.01"], "lightning"),
    "gpt": ([EXAMPLES / "train_gpt.py", "--print-every", "50", "--step-sleep", "0.01"], None),
}


def _checks(cli, pid) -> list:
    r = cli(
        pid, "query", "SELECT step, invariant, ok, subject, detail FROM torch.checks ORDER BY step", "--format", "json"
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("job", list(JOBS))
def test_healthy_jobs_keep_every_invariant(spawn, cli, job):
    args, needs = JOBS[job]
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed")
    # given: a healthy job, past a few measured steps with a backward between them
    proc = spawn(args, env={"PROBE": "1"}, ready="ready" if job != "gpt" else "step 50", timeout=180)
    rows: list = []

    def enough():
        rows[:] = _checks(cli, proc.pid)
        return sum(r["invariant"] == "grads_cleared" for r in rows) >= 3

    assert poll(enough, 120, interval=1.0), rows  # a query a second: the checks come with measured steps
    # then: each invariant checked held, and the doctor finds nothing above info (but what reads the host's load)
    assert {r["invariant"] for r in rows} >= {"grads_present", "grads_cleared"}, rows
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    findings = doctor(cli, proc.pid)["findings"]
    assert not above_info(findings), findings
