"""Guarded actions driven through the real `probe` command against real training processes."""

from __future__ import annotations

import json
import os
import re
import socket

import pytest

from conftest import TARGETS, requires_torch
from harness import audit_records

pytestmark = requires_torch
TRAIN = TARGETS / "actions_train.py"


def actions_rows(cli, pid) -> list[dict]:
    r = cli(
        pid,
        "query",
        "SELECT id, command, state, step, started_at, error FROM probe.actions ORDER BY id",
        "--format",
        "json",
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def lr_of(cli, pid) -> float:
    """The lr group 0's next step uses (an lr override applies during the step; param_groups keeps the loop's)."""
    r = cli(pid, "query", "SELECT lr FROM torch.optimizer WHERE param_group = 0", "--format", "json")
    assert r.returncode == 0, r.stderr
    return float(json.loads(r.stdout)[0]["lr"])


def test_eval_output_value_locals_and_own_traceback(spawn, cli, probe_env):
    p = spawn([TRAIN, "--sched", "none"])
    # given a multi-line snippet: prints, stderr and a final expression
    r = cli(
        p.pid, "eval", "import sys\nprint('lr', optimizer.param_groups[0]['lr'])\nprint('warn', file=sys.stderr)\n6 * 7"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["lr 0.05", "42"]
    assert "warn" in r.stderr
    # at a safe point the training loop's locals resolve
    r = cli(p.pid, "eval", "--at-step", "print(type(loss).__name__, tuple(batch.shape), step == trainer_state['step'])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "Tensor (4, 8) True"
    # -f file.py
    snippet = os.path.join(probe_env["PROBE_RUNTIME_DIR"], "snippet.py")
    with open(snippet, "w") as f:
        f.write("n = sum(p.numel() for p in model.parameters())\nn\n")
    r = cli(p.pid, "eval", "-f", snippet)
    assert r.returncode == 0 and r.stdout.strip() == str(8 * 16 + 16 + 16 + 1)
    # a failing eval: its own traceback only, non-zero exit, training goes on
    r = cli(p.pid, "eval", "def f():\n    return 1 / 0\nf()")
    assert r.returncode == 5
    assert "ZeroDivisionError" in r.stderr and "<probe-eval-" in r.stderr
    assert "_eval.py" not in r.stderr and "_actions.py" not in r.stderr
    step = int(re.search(r"step (\d+)", p.wait_for("step ")).group(1))
    p.wait_for(f"step {step + 3} ")
    r = cli(p.pid, "eval", "1 +")
    assert r.returncode == 5 and "does not parse" in r.stderr


def test_refusals_are_clear_and_audited(spawn, cli, probe_env, tmp_path):
    p = spawn([TRAIN, "--sched", "none"], env={"PROBE_ALLOW_EVAL": "0"})
    r = cli(p.pid, "eval", "1")
    assert r.returncode == 4 and "PROBE_ALLOW_EVAL" in r.stderr and "Traceback" not in r.stderr
    ckpt = tmp_path / "c.pt"
    ckpt.write_bytes(b"old")
    r = cli(p.pid, "checkpoint", ckpt)
    assert r.returncode == 5 and "--force" in r.stderr
    assert ckpt.read_bytes() == b"old"
    r = cli(p.pid, "lr", "--scale", "-1")
    assert r.returncode == 5 and "negative" in r.stderr
    r = cli(p.pid, "lr")
    assert r.returncode == 2 and "--set" in r.stderr
    outcomes = [(a["command"], a["outcome"]) for a in audit_records(probe_env)]
    assert outcomes == [("eval", "refused"), ("checkpoint", "refused"), ("lr", "refused")]
    # a refused action never becomes a tracked action
    assert actions_rows(cli, p.pid) == []


def test_tcp_tiers(spawn, cli, probe_env):
    def tcp_target(extra):
        p = spawn([TRAIN, "--sched", "none"], env={"PROBE_PORT": "0", "PROBE_TOKEN": "s3cret", **extra})
        with open(os.path.join(probe_env["PROBE_RUNTIME_DIR"], f"{p.pid}.json")) as f:
            return p, f"127.0.0.1:{json.load(f)['tcp_port']}"

    p, endpoint = tcp_target({})
    r = cli("-t", endpoint, "--token", "wrong", "cleanup")  # refused by the CLI itself: the proof does not fit
    assert r.returncode == 4 and "wrong token" in r.stderr
    host, port = endpoint.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:  # a request with a wrong token, sent anyway
        s.sendall(b"POST /actions/cleanup HTTP/1.1\r\nAuthorization: Bearer wrong\r\nContent-Length: 0\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 401")
    r = cli("-t", endpoint, "--token", "s3cret", "eval", "1")
    assert r.returncode == 4 and "PROBE_ALLOW_EVAL=1" in r.stderr
    r = cli("-t", endpoint, "--token", "s3cret", "cleanup")
    assert r.returncode == 0, r.stderr
    records = [a for a in audit_records(probe_env) if a["pid"] == p.pid]
    assert [(a["command"], a["outcome"], a["client"]["transport"]) for a in records] == [
        ("cleanup", "refused", "tcp"),
        ("eval", "refused", "tcp"),
        ("cleanup", "queued", "tcp"),
        ("cleanup", "done", "tcp"),
    ]
    p2, endpoint2 = tcp_target({"PROBE_ALLOW_EVAL": "1"})
    r = cli("-t", endpoint2, "--token", "s3cret", "eval", "import os; os.getpid()")
    assert r.returncode == 0 and r.stdout.strip() == str(p2.pid)


def test_now_on_stuck_training_thread(spawn, cli, tmp_path):
    p = spawn([TRAIN, "--sched", "StepLR", "--hang-after", "3"], ready="hanging")
    r = cli(p.pid, "cleanup", "--now")
    assert r.returncode == 0, r.stderr
    assert "server thread" in r.stderr  # the CLI says what --now risks
    target = tmp_path / "stuck.pt"
    r = cli(p.pid, "checkpoint", target, "--now")
    assert r.returncode == 0, r.stderr
    import torch

    state = torch.load(target)
    assert state["step"] == 3 and state["probe"]["at_safe_point"] is False
    # without --now the action waits for a step that never comes, then times out
    r = cli("--timeout", "1", p.pid, "cleanup")
    assert r.returncode == 5 and "timed out" in r.stderr


def test_timed_out_action_never_runs_late_and_audit_agrees(spawn, cli, probe_env):
    stall = os.path.join(probe_env["PROBE_RUNTIME_DIR"], "stall")
    p = spawn([TRAIN, "--sched", "none", "--stall-file", stall])
    before = lr_of(cli, p.pid)
    open(stall, "w").close()
    p.wait_for("stalled")
    # given a stalled training thread, a queued lr change times out
    r = cli("--timeout", "1", p.pid, "lr", "--set", "0.5")
    assert r.returncode == 5 and "timed out" in r.stderr and "will not run" in r.stderr
    # when training resumes, the change must not be applied late
    os.unlink(stall)
    resumed = int(re.search(r"resumed at step (\d+)", p.wait_for("resumed")).group(1))
    p.wait_for(f"step {resumed + 3} ")
    assert lr_of(cli, p.pid) == before
    r = cli(p.pid, "lr", "--set", "0.02")
    assert r.returncode == 0 and "0.05 -> 0.02" in r.stdout
    r = cli(p.pid, "eval", "--at-step", "raise RuntimeError('boom')")
    assert r.returncode == 5
    rows = actions_rows(cli, p.pid)
    assert [(a["command"], a["state"]) for a in rows] == [("lr", "timed_out"), ("lr", "done"), ("eval", "failed")]
    assert rows[0]["started_at"] is None
    # the audit log tells the same story: one final record per action, with the same outcome
    final = {a["id"]: a["outcome"] for a in audit_records(probe_env) if a["outcome"] not in ("queued", "running")}
    assert final == {row["id"]: row["state"] for row in rows}
    assert all(a["client"]["transport"] == "unix" for a in audit_records(probe_env))


def test_several_targets_need_yes_and_act_at_one_step(spawn, cli, probe_env):
    procs = [
        spawn([TRAIN, "--sched", "none", "--step-sleep", "0.2"], env={"RANK": str(r), "WORLD_SIZE": "2"})
        for r in (0, 1)
    ]
    r = cli("--ranks", "all", "lr", "--scale", "0.5")
    assert r.returncode != 0 and "--yes" in r.stderr
    # the pace the common step is chosen by counts whole steps only: step 1 runs from its first module call (~3 ms
    # here, against 200 ms steps), and counted it made the CLI aim a hundred steps ahead
    status = cli("--ranks", "all", "--format", "json", "status")
    assert all(s["step_time"] is None or s["step_time"] > 0.15 for s in json.loads(status.stdout)), status.stdout
    r = cli("--ranks", "all", "--yes", "--format", "json", "lr", "--scale", "0.5")
    assert r.returncode == 0, r.stderr
    outcomes = json.loads(r.stdout)
    assert len(outcomes) == 2
    assert (
        {o["action"]["step"] for o in outcomes}
        == {o["action"]["at_step"] for o in outcomes}
        == {outcomes[0]["action"]["at_step"]}
    )
    for proc in procs:
        assert lr_of(cli, proc.pid) == pytest.approx(0.025)
    r = cli("--ranks", "all", "--yes", "checkpoint", os.path.join(probe_env["PROBE_RUNTIME_DIR"], "same.pt"))
    assert r.returncode != 0 and "{rank}" in r.stderr
    # partial failure: one rank gone -> per-rank output and a non-zero exit
    procs[1].popen.kill()
    procs[1].popen.wait()
    r = cli("--ranks", "0-1", "--yes", "cleanup")
    assert r.returncode != 0
    assert "rank 1" in r.stderr
