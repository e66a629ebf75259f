"""The doctor on real-world silent errors (tests/faults/real_world.py, each from a public report cited there): it
names each with the rule the corpus gives (tests/faults/corpus.py) and the names the user needs, and the healthy
twins (the same script with --fixed) get nothing above info. A group of errors runs as phases of one process (the
test tells the target when to go on: a file per phase), then the group's twins run the same way, each phase as
far past its onset as its error took to be named. The input-bound errors of the starved group run on a core the
job shares with a CPU hog. Each phase prints the steps and seconds from the error's onset to the doctor naming it
(docs/doctor.md has the table)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time

import pytest

from _doctor import above_info, doctor
from harness import max_step, query_json, stop_groups
from conftest import ROOT, requires_torch

from faults.corpus import ERRORS, GROUPS, STARVED

pytestmark = requires_torch
SCRIPT = ROOT / "tests" / "faults" / "real_world.py"
RULES = {e: (rule, words) for e, rule, words in ERRORS}
_DETECT_S = 120  # a deadline, not an expectation: most are named within a few doctor runs


def _onset(job, error) -> tuple[int, float]:
    line = job.wait_for(f"onset error={error} ", 180)
    step, at = re.search(r"step=(\d+) time=([\d.]+)", line).groups()
    return int(step), float(at)


def _named(cli, pid, rule, words, onset_step):
    """Run the doctor until ``rule`` names this phase's error (its words; an invariant's first failing check after
    the onset, so that an earlier phase's finding cannot pass); (that finding or None at the deadline, the last
    findings)."""
    deadline = time.monotonic() + _DETECT_S
    while True:
        findings = doctor(cli, pid)["findings"]
        for f in findings:
            since = f["evidence"].get("since")  # an invariant rule's first failing check (a step)
            if (
                f["rule"] == rule
                and all(w in f["message"] for w in words)
                and (type(since) is not int or since > onset_step)
            ):
                return f, findings
        if time.monotonic() > deadline:
            return None, findings
        time.sleep(1.0)  # ok-sleep: polling with a deadline; a doctor run is ~0.8 s of CPU the job would share


def test_the_corpus_is_grouped_and_cited():
    grouped = [e for g in GROUPS + STARVED for e in g]
    assert sorted(grouped) == sorted(RULES), "every corpus error runs in exactly one group"
    text = SCRIPT.read_text()
    for error in RULES:
        assert f"* ``{error}``" in text, f"{error} has no cited description in {SCRIPT.name}"
    assert len(RULES) >= 16


@pytest.mark.phases
@pytest.mark.parametrize("group", GROUPS, ids=[g[0] for g in GROUPS])
def test_the_doctor_names_real_world_errors_and_not_their_healthy_twins(spawn, cli, tmp_path, group):
    _named_and_twins_quiet(spawn, cli, tmp_path, group)


@pytest.mark.phases
@pytest.mark.parametrize("group", STARVED, ids=[g[0] for g in STARVED])
def test_input_bound_jobs_on_a_starved_core_are_named_input_bound_and_starved(spawn, cli, tmp_path, group):
    """Each job, and its twin, shares one core with a CPU hog (both pinned there): an input-bound loop there is named
    input bound and starved at once, and the twin (its samples prepared once) is not called input bound."""
    cpu = min(os.sched_getaffinity(0))
    with _hog(cpu):
        _named_and_twins_quiet(spawn, cli, tmp_path, group, cpu=cpu)


@contextlib.contextmanager
def _hog(cpu: int):
    # in a session of its own, as the job is: with autogroup scheduling each session has an equal share of the core
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        yield
    finally:
        hog.kill()
        hog.wait()


def _named_and_twins_quiet(spawn, cli, tmp_path, group, cpu=None):
    """The group's errors as phases of one job, each named; then the twins as phases of another, each as far past
    its onset as its error took to be named, with nothing above info. ``cpu``: both jobs are pinned to that core, and
    the twins are not input bound either (a rule about the host that ``above_info`` leaves out)."""
    nxt = tmp_path / "next"
    nxt.mkdir()
    # given: the group's errors, one phase each
    job = spawn(
        [SCRIPT, "--errors", ",".join(group), "--next-dir", nxt], env={"PROBE": "1"}, ready="ready", timeout=180
    )
    if cpu is not None:
        os.sched_setaffinity(job.pid, {cpu})
    took, missed = {}, []
    for error in group:
        rule, words = RULES[error]
        onset_step, onset_time = _onset(job, error)
        # when / then: the doctor names it, with the names the user needs
        finding, last = _named(cli, job.pid, rule, words, onset_step)
        if finding is None:  # what the next look at a miss needs: the findings, and the measured rows since the onset
            after = f"step >= {onset_step}"
            seen = query_json(
                cli,
                job.pid,
                f"SELECT (SELECT count(*) FROM torch.steps WHERE measured AND {after}) AS measured, parameter, "
                "count(*) AS updates, list(step ORDER BY step)[-8:] AS last_steps, min(norm) AS low, "
                f"max(norm) AS high, max(ratio) AS top FROM torch.updates WHERE {after} - 300 GROUP BY parameter",
            )
            missed.append((error, [(f["rule"], f["message"][:200]) for f in last], seen))
        else:
            seconds, steps = time.time() - onset_time, max_step(cli, job.pid) - onset_step
            since = finding["evidence"].get("since")
            since = since if type(since) is int else None
            # what the twin must get past: the steps to the first failing check and two more measured ones (an
            # invariant), or as many steps as it took (a rule over the state at query time)
            took[error] = min(steps, since - onset_step + 30) if since else min(steps, 60)
            print(
                f"\n{error}: {rule} after {steps} steps, {seconds:.1f} s from onset"
                + (f"; first failing check at step {since} ({since - onset_step} steps after onset)" if since else "")
            )
            assert finding["severity"] in ("critical", "warning"), finding
        (nxt / error).touch()
        job.wait_for(f"phase-end error={error} optimizer-freed=True", 60) if error != group[-1] else None
    stop_groups([job.popen], grace=5)  # one job at a time on 2 cores
    assert not missed, f"not named: {missed}"

    # and: the healthy twins, each as far past its onset as its error took to be named, get nothing above info
    fixed = tmp_path / "next-fixed"
    fixed.mkdir()
    reach = ",".join(str(took[error] + 5) for error in group)
    twin = spawn(
        [SCRIPT, "--errors", ",".join(group), "--fixed", "--next-dir", fixed, "--reach", reach],
        env={"PROBE": "1"},
        ready="ready",
        timeout=180,
    )
    if cpu is not None:
        os.sched_setaffinity(twin.pid, {cpu})
    for error in group:
        _onset(twin, error)
        twin.wait_for(f"reached error={error} ", 120)  # the twin's own step count, as torch.steps counts
        findings = doctor(cli, twin.pid)["findings"]
        assert not above_info(findings), (error, findings)
        if cpu is not None:  # the twin of an input-bound loop: no longer input bound
            assert not [f for f in findings if f["rule"] == "input_bound"], (error, findings)
        (fixed / error).touch()
