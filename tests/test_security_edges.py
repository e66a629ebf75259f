"""Hardening, round 3 (issue 25, items 1, 2, 3 and 8): who runs what, what a rate may be, what a shared
registry may hold, and the edges of checkpoint paths and injection, each against a real process."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TARGETS, poll, requires_torch

PLAIN = TARGETS / "plain_loop.py"
ACTIONS = TARGETS / "actions_train.py"


# -- item 1: probe never runs a file the target's owner controls ------------------------------------------

def _swap_for_script(path: Path, marker: Path) -> None:
    """What the target's owner can do after start: put a script where the running binary was."""
    path.unlink()
    path.write_text(f"#!/bin/sh\ntouch {marker}\nexec sleep 100\n")
    path.chmod(0o755)


def test_a_binary_named_python_is_never_run_to_learn_its_version(spawn, cli, tmp_path):
    # given a copy of `sleep` named `python` (no libpython, no version in its name), replaced on disk by a
    # script after it started, as the process's owner could
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "python"
    shutil.copy2(shutil.which("sleep"), fake)
    target = spawn([str(fake), "100"], ready=None)
    poll(lambda: os.readlink(f"/proc/{target.pid}/exe").startswith(str(fake)))
    marker = tmp_path / "ran-as-prober"
    _swap_for_script(fake, marker)
    # when root (or any user) asks for its stacks and tries to inject
    bt = cli(target.pid, "backtrace")
    inj = cli("inject", target.pid)
    # then nothing ran the file, and each command says why in one sentence
    assert not marker.exists(), "probe executed the target's executable"
    for r in (bt, inj):
        assert r.returncode == 11, r.stdout + r.stderr
        assert "never runs a target's executable" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert target.popen.poll() is None


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3.11"), reason="no statically linked /usr/bin/python3.11 here")
def test_a_static_python_without_version_in_its_name_is_recognised_from_its_symbols(spawn, cli, tmp_path):
    # given Debian's static interpreter (no libpython) copied under the bare name `python`
    exe = tmp_path / "python"
    shutil.copy2("/usr/bin/python3.11", exe)
    code = "import time\ndef wait_here():\n    time.sleep(100)\nprint('ready', flush=True)\nwait_here()\n"
    target = spawn([str(exe), "-S", "-c", code])
    # when / then its version is read from its Py_Version symbol and py-spy reads its stacks
    r = cli(target.pid, "backtrace")
    assert "not a Python process" not in r.stderr and "never runs" not in r.stderr, r.stderr
    assert r.returncode == 0 and "wait_here" in r.stdout, r.stdout + r.stderr


# -- item 2: a learning rate no step could use (or that cannot train) is refused before anything is queued --

def _last_step(proc) -> int:
    steps = [int(l.split()[1]) for l in proc.lines if l.startswith("step ")]
    return steps[-1] if steps else 0


def _steps_on(proc, after: int) -> bool:
    return bool(poll(lambda: proc.popen.poll() is None and _last_step(proc) > after + 2, timeout=60))


def _lr_actions(cli, pid) -> list:
    r = cli(pid, "query", "SELECT id, state FROM probe.actions WHERE command = 'lr'", "--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _audit(env) -> list:
    with open(os.path.join(env["PROBE_RUNTIME_DIR"], "audit.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@requires_torch
@pytest.mark.parametrize("optim, dtype, argv, words", [
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
])
def test_a_rate_that_would_kill_or_stall_the_job_is_refused_and_nothing_is_queued(spawn, cli, probe_env, optim,
                                                                                   dtype, argv, words):
    # given a training job (no scheduler: the rate stays 0.05)
    p = spawn([ACTIONS, "--sched", "none", "--optim", optim, "--dtype", dtype, "--step-sleep", "0.05"])
    # when the CLI asks for the rate
    r = cli(p.pid, "--yes", "lr", *argv)
    # then one sentence, a non-zero exit, nothing queued, a refusal in the audit log, and the job steps on
    assert r.returncode != 0, r.stdout + r.stderr
    assert words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert _lr_actions(cli, p.pid) == []
    refused = [a for a in _audit(probe_env) if a.get("command") == "lr"]
    assert refused and all(a.get("outcome") == "refused" for a in refused), refused
    assert _steps_on(p, _last_step(p)), p.output()[-2000:]


@requires_torch
def test_asked_for_a_zero_or_a_big_jump_is_applied_and_the_job_steps_on(spawn, cli):
    p = spawn([ACTIONS, "--sched", "none", "--step-sleep", "0.05"])
    r = cli(p.pid, "--yes", "lr", "--set", "2", "--force")
    assert r.returncode == 0 and "0.05 -> 2" in r.stdout, r.stdout + r.stderr
    r = cli(p.pid, "--yes", "lr", "--set", "0", "--allow-zero")
    assert r.returncode == 0 and "2 -> 0" in r.stdout, r.stdout + r.stderr
    assert poll(lambda: any(l.startswith("step ") for l in p.lines)) and _steps_on(p, _last_step(p))


@requires_torch
def test_the_http_route_refuses_the_same_rates(spawn, cli, probe_env):
    # given the route every tier reaches (the page, MCP and TCP post the same body)
    p = spawn([ACTIONS, "--sched", "none", "--optim", "Adam", "--step-sleep", "0.05"])
    with open(f"{probe_env['PROBE_RUNTIME_DIR']}/{p.pid}.json") as f:
        sock = json.load(f)["socket"]
    from test_hardening import _post

    for body, words in (({"set": 1e39, "force": True}, "would overflow"), ({"scale": 1e308}, "would overflow"),
                        ({"set": 0.0}, "--allow-zero"), ({"set": 1.0}, "--force"), ({"set": "NaN"}, "finite")):
        status, doc = _post(sock, "/actions/lr", json.dumps(body).encode())
        assert 400 <= status < 500 and words in json.dumps(doc), (body, status, doc)
    assert _lr_actions(cli, p.pid) == []
    assert _steps_on(p, _last_step(p))
