"""`probe ENDPOINT profile-steps N -o FILE`: torch.profiler over the next N steps of a live job."""

from __future__ import annotations

import json
import subprocess

from conftest import PROBE_BIN, TARGETS, requires_torch

pytestmark = requires_torch


def test_profile_steps_writes_a_chrome_trace_and_removes_the_profiler(spawn, cli, tmp_path, probe_env):
    train = spawn(
        [TARGETS / "actions_train.py", "--sched", "none", "--step-sleep", "0.05"],
        env={"PROBE_PORT": "0", "PROBE_TOKEN": "s3cret"},
    )
    out = tmp_path / "prof.json"
    r = cli(train.pid, "profile-steps", "3", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "profiling steps" in r.stderr
    doc = json.loads(out.read_text())
    names = {e.get("name") for e in doc["traceEvents"]}
    assert any(str(n).startswith("ProfilerStep#") for n in names), "step boundaries are marked"
    assert any(str(n).startswith("aten::") for n in names), "operators of the training loop were recorded"
    # the profiler exists only during those steps
    r = cli(
        train.pid,
        "eval",
        "import torch; from probe.training import boundary; "
        "print(torch.autograd.profiler._is_profiler_enabled, "
        "any('profiler' in getattr(f, '__module__', '') for f in boundary.after))",
    )
    assert r.returncode == 0 and r.stdout.split() == ["False", "False"], r.stdout + r.stderr
    # audited like every action
    rows = json.loads(
        cli(
            train.pid,
            "--format",
            "json",
            "query",
            "SELECT command, state FROM probe.actions WHERE command = 'profile-steps'",
        ).stdout
    )
    assert rows == [{"command": "profile-steps", "state": "done"}]
    # over TCP the trace is read back in chunks through the connection
    entry = next(e for e in json.loads(cli("list", "--json").stdout) if e["pid"] == train.pid)
    port = entry["endpoint"].rsplit(":", 1)[1]
    r = cli("-t", f"127.0.0.1:{port}", "--token", "s3cret", "profile-steps", "2", "-o", tmp_path / "tcp.json")
    assert r.returncode == 0, r.stderr
    assert any(
        str(e.get("name")).startswith("ProfilerStep#")
        for e in json.loads((tmp_path / "tcp.json").read_text())["traceEvents"]
    )


def test_profile_steps_refuses_a_second_profile_and_bad_input(spawn, cli, tmp_path, probe_env):
    train = spawn([TARGETS / "actions_train.py", "--sched", "none", "--step-sleep", "0.2"])
    first = subprocess.Popen(
        [PROBE_BIN, str(train.pid), "profile-steps", "30", "-o", str(tmp_path / "a.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=probe_env,
    )
    try:
        line = first.stderr.readline()  # printed once the profiler runs (30 steps of >= 0.2 s follow)
        assert "profiling steps" in line, line + first.stderr.read()
        r = cli(train.pid, "profile-steps", "2", "-o", tmp_path / "b.json")
        assert r.returncode != 0 and "already running" in r.stderr and "Traceback" not in r.stderr
    finally:
        first.kill()
        first.wait(10)
    r = cli(train.pid, "profile-steps", "0", "-o", tmp_path / "c.json")
    assert r.returncode != 0 and "from 1 to 100" in r.stderr and "Traceback" not in r.stderr
    r = cli(train.pid, "profile-steps", "2", "-o", tmp_path / "missing" / "c.json")
    assert r.returncode != 0 and "directory does not exist" in r.stderr
