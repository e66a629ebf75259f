"""`probe lr`: the override holds through the scheduler, checked several steps later against a replayed schedule."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import types

import pytest

from conftest import TARGETS, poll, requires_torch
from harness import query_json

pytestmark = requires_torch
TRAIN = TARGETS / "actions_train.py"
SCHEDULERS = ["StepLR", "CosineAnnealingLR", "LambdaLR", "LinearLR", "OneCycleLR", "ReduceLROnPlateau", "SequentialLR"]


def reference_lr(name: str, epoch: int) -> float:
    """What the unchanged schedule gives at ``epoch``, replayed in this process from the target's own code."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("actions_train_ref", TRAIN)
    mod = importlib.util.module_from_spec(spec)
    # its `import probe.auto` must start nothing in the test process: a probe there would wrap torch for every
    # later test of this worker (tests/unit/test_loss_capture.py's own wrapper then saw no backward call)
    started = sys.modules.get("probe.auto")
    sys.modules["probe.auto"] = types.ModuleType("probe.auto")
    try:
        spec.loader.exec_module(mod)
    finally:
        if started is None:
            del sys.modules["probe.auto"]
        else:
            sys.modules["probe.auto"] = started
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.05, momentum=0.9)
    sched = mod.make_scheduler(name, opt)
    for i in range(epoch):
        opt.step()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(1.0 / (i + 1))
        else:
            sched.step()
    return opt.param_groups[0]["lr"]


@pytest.mark.parametrize("name", SCHEDULERS)
def test_scaled_lr_survives_the_scheduler(name, spawn, cli, probe_env):
    stall = os.path.join(probe_env["PROBE_RUNTIME_DIR"], "stall")
    p = spawn([TRAIN, "--sched", name, "--step-sleep", "0.01", "--stall-file", stall])
    # when
    r = cli(p.pid, "lr", "--scale", "0.5")
    assert r.returncode == 0, r.stderr
    before, after = map(float, re.search(r"group 0: (\S+) -> ([^;\s]+)", r.stdout).groups())
    assert after == pytest.approx(before * 0.5, rel=1e-5)  # printed with 6 significant digits
    applied = int(re.search(r"from step (\d+)", r.stdout).group(1)) - 1
    assert re.search(rf"step {applied + 1} used \S+", r.stdout), r.stdout  # the reply comes after the next step used it
    p.wait_for(f"step {applied + 6} ")
    open(stall, "w").close()
    p.wait_for("stalled")
    # then: read through torch.optimizer while the loop is paused; compare with the replayed schedule
    q = cli(
        p.pid,
        "query",
        "SELECT lr, loop_lr, lr_override, lr_override_status, scheduler FROM torch.optimizer WHERE param_group = 0",
        "--format",
        "json",
    )
    assert q.returncode == 0, q.stderr
    row = json.loads(q.stdout)[0]
    # a torch scheduler drives the rate: the change went into what it computes from, so param_groups (what the
    # loop's own logs read) shows the rate in effect, half of the unchanged schedule's
    assert "through its scheduler's base rates" in r.stdout, r.stdout
    assert row["scheduler"] == name and row["lr_override"] == "scale 0.5 (scheduler base)", row
    assert "param_groups shows the rate in effect" in row["lr_override_status"], row
    e = cli(p.pid, "eval", "scheduler.last_epoch")
    epoch = int(e.stdout)
    assert epoch >= applied + 5
    assert row["loop_lr"] == pytest.approx(0.5 * reference_lr(name, epoch), rel=1e-6)
    assert row["lr"] == row["loop_lr"]  # what the next step uses
    g = cli(p.pid, "eval", "print(optimizer.param_groups[0]['lr'])")
    assert float(g.stdout) == pytest.approx(0.5 * reference_lr(name, epoch), rel=1e-6), g.stdout
    os.unlink(stall)
    # and --reset gives the unchanged schedule back
    r = cli(p.pid, "lr", "--reset")
    assert r.returncode == 0 and "removed scale 0.5 (scheduler base)" in r.stdout, r.stdout
    open(stall, "w").close()
    assert poll(lambda: sum(line.startswith("stalled at step") for line in list(p.lines)) >= 2, timeout=60)
    epoch = int(cli(p.pid, "eval", "scheduler.last_epoch").stdout)
    g = cli(p.pid, "eval", "print(optimizer.param_groups[0]['lr'])")
    assert float(g.stdout) == pytest.approx(reference_lr(name, epoch), rel=1e-6), g.stdout
    os.unlink(stall)


def test_group_errors_once_and_reset(spawn, cli):
    p = spawn([TRAIN, "--sched", "SequentialLR"])
    r = cli(p.pid, "lr", "--set", "0.1", "--group", "3")
    assert r.returncode == 5 and "param group" in r.stderr and "Traceback" not in r.stderr
    r = cli(p.pid, "lr", "--reset")
    assert r.returncode == 5 and "no lr override" in r.stderr
    # --once: ExponentialLR (inside SequentialLR) rewrites the rate before the next step: said, not reported as done
    r = cli(p.pid, "lr", "--set", "0.1", "--once", "--group", "0")
    assert r.returncode != 0 and "rewrote group 0's lr" in r.stderr and "without --once" in r.stderr, r.stderr
    # held: the scheduler's base rate is set so that its rate is 0.1 now; ExponentialLR goes on from there
    r = cli(p.pid, "lr", "--set", "0.1")
    m = re.search(r"group 0: \S+ -> 0\.1; step \d+ used (\S+)", r.stdout)
    assert r.returncode == 0 and m and float(m.group(1)) == pytest.approx(0.09, rel=1e-3), r.stdout
    r = cli(p.pid, "lr", "--reset")
    assert r.returncode == 0 and re.search(r"removed set 0\.1 \(scheduler base\) after \d+ step", r.stdout), r.stdout
    q = cli(p.pid, "query", "SELECT lr, loop_lr, lr_override FROM torch.optimizer", "--format", "json")
    row = json.loads(q.stdout)[0]
    assert row["lr_override"] is None and row["lr"] == row["loop_lr"]


def _steps_after(cli, pid, step: int) -> list:
    return query_json(cli, pid, f"SELECT step, lr, loss FROM torch.steps WHERE step > {step} ORDER BY step")


def test_a_rate_the_parameters_dtype_cannot_hold_is_refused_and_never_reaches_the_schedule(spawn, cli):
    p = spawn([TRAIN, "--sched", "StepLR", "--step-sleep", "0.01"])
    # 5e-324 passes "> 0" but is 0 in float32; a scale whose product is below float32's smallest normal likewise
    for args in (["--set", "5e-324"], ["--scale", "1e-40"]):
        r = cli(p.pid, "lr", *args)
        assert r.returncode != 0 and "Traceback" not in r.stderr, (args, r.stdout, r.stderr)
        assert "float32" in r.stderr and "1.17549e-38" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    # nothing was installed: a reset has nothing to divide out, and the steps that follow keep a finite rate and loss
    r = cli(p.pid, "lr", "--reset")
    assert r.returncode == 5 and "no lr override" in r.stderr, r.stderr
    # the smallest rate float32 holds is taken, and going back to a normal rate from there is no jump
    r = cli(p.pid, "lr", "--set", "1.2e-38")
    assert r.returncode == 0, r.stderr
    r = cli(p.pid, "lr", "--set", "0.05")
    assert r.returncode == 0 and "through its scheduler's base rates" in r.stdout, r.stderr
    # a rate of 0 (asked for) then a reset leaves the schedule where it was, never at 0 or NaN
    r = cli(p.pid, "lr", "--set", "0", "--allow-zero")
    assert r.returncode == 0, r.stderr
    r = cli(p.pid, "lr", "--reset")
    assert r.returncode == 0, r.stderr
    reset_at = int(re.search(r"applies from step (\d+)", r.stdout).group(1))
    p.wait_for(f"step {reset_at + 4} ")
    rows = _steps_after(cli, p.pid, reset_at)
    assert len(rows) >= 3, rows
    for row in rows:
        assert row["lr"] is not None and 0 < row["lr"] < 1 and math.isfinite(row["loss"]), rows
    assert rows[-1]["lr"] == pytest.approx(reference_lr("StepLR", rows[-1]["step"] - 1), rel=1e-5), rows


def test_lr_on_a_loop_that_never_writes_its_rate_says_the_change_is_simply_kept(spawn, cli):
    p = spawn([TRAIN, "--sched", "none", "--step-sleep", "0.01"])
    r = cli(p.pid, "lr", "--scale", "0.5")
    assert r.returncode == 0, r.stderr
    assert "writes its own rate" not in r.stdout and "nothing rewrote" in r.stdout, r.stdout
    assert re.search(r"group 0: 0\.05 -> 0\.025; step \d+ used 0\.025", r.stdout), r.stdout
