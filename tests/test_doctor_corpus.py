"""The doctor on real-world silent errors (tests/faults/real_world.py, each from a public report cited there):
it names each with the rule the corpus gives (tests/faults/corpus.py) and the names the user needs, and the
healthy twin (the same script with --fixed) gets nothing above info. Each run prints the steps and seconds
from the error's onset to the doctor naming it (docs/doctor.md has the table)."""

from __future__ import annotations

import json
import re
import time

import pytest

from _doctor import doctor, poll_for
from harness import stop_groups
from conftest import ROOT, poll, requires_torch

from faults.corpus import ERRORS

pytestmark = requires_torch
SCRIPT = ROOT / "tests" / "faults" / "real_world.py"


def _step(cli, pid) -> int:
    r = cli(pid, "query", "SELECT max(step) AS step FROM torch.steps", "--format", "json")
    return json.loads(r.stdout)[0]["step"] or 0


@pytest.mark.parametrize("error, rule, words", ERRORS, ids=[e[0] for e in ERRORS])
def test_the_doctor_names_a_real_world_error_and_not_its_healthy_twin(spawn, cli, error, rule, words):
    # given: the error, past its onset
    job = spawn([SCRIPT, "--error", error], env={"PROBE": "1"}, ready="ready", timeout=180)
    onset = job.wait_for("onset", 120)
    onset_step, onset_time = (float(v) for v in re.search(r"step=(\d+) time=([\d.]+)", onset).groups())
    # when / then: the doctor names it, with the names the user needs
    finding, _ = poll_for(cli, job.pid, rule, timeout=90)
    seconds, steps = time.time() - onset_time, _step(cli, job.pid) - onset_step
    since = finding["evidence"].get("since")  # an invariant's first failing check: where the job itself showed it
    print(f"\n{error}: {rule} after {steps:.0f} steps, {seconds:.1f} s from onset"
          + (f"; first failing check at step {since} ({since - onset_step:.0f} steps after onset)" if since else "")
          + f"; subject {finding['evidence'].get('subject')}")
    assert finding["severity"] in ("critical", "warning"), finding
    for w in words:
        assert w in finding["message"], finding
    stop_groups([job.popen], grace=5)  # one job at a time on 2 cores

    # and: its healthy twin, as far past the onset, gets nothing above info
    twin = spawn([SCRIPT, "--error", error, "--fixed"], env={"PROBE": "1"}, ready="ready", timeout=180)
    twin.wait_for("onset", 120)
    assert poll(lambda: _step(cli, twin.pid) >= onset_step + steps + 5, 120)
    findings = doctor(cli, twin.pid)["findings"]
    assert not [f for f in findings if f["severity"] in ("critical", "warning")], findings
