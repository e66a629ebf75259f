"""Every step's core signals: the loss, lr, duration and a memory reading on every step,
whatever the step budget measured, and the doctor's rules that read them (memory_growth by time,
input_bound from every step's data_wait, so that two DataLoader workers cannot hide the slow half)."""

from __future__ import annotations

import re

import pytest

from _doctor import doctor, poll_for
from conftest import TARGETS, poll, requires_torch
from harness import query_json

pytestmark = requires_torch
NANOGPT = TARGETS / "nanogpt_loop.py"
ITER = re.compile(r"^iter (\d+): loss (\S+), lr (\S+)$")


def printed(proc) -> dict[int, tuple[float, float]]:
    """What the loop printed: {iteration (from 0): (loss, lr)}."""
    out = {}
    for line in list(proc.lines):
        m = ITER.match(line)
        if m:
            out[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return out


def test_a_nanogpt_shaped_loop_has_the_loss_and_lr_it_prints_on_every_step(spawn, cli):
    # given: a loop that writes every group's lr itself, accumulates 2 micro-batches through a disabled
    # GradScaler, clips, and prints its loss every 5 iterations; the probe at its defaults
    proc = spawn([NANOGPT, "--log-every", "5", "--step-sleep", "0.002"], env={"PROBE": "1"})
    assert poll(lambda: max(printed(proc), default=0) >= 400, timeout=180), proc.output()[-2000:]
    logged = printed(proc)
    last = max(logged) + 1  # probe counts steps from 1, the loop its iterations from 0
    rows = query_json(
        cli, proc.pid, f"SELECT step, loss, lr, measured, memory FROM torch.steps WHERE step <= {last} ORDER BY step"
    )
    # then: one row per iteration, the loss on >= 99 % of them whatever was measured, a memory reading on each
    assert [r["step"] for r in rows] == list(range(1, last + 1))
    with_loss = [r for r in rows if r["loss"] is not None]
    assert len(with_loss) >= 0.99 * len(rows), (len(with_loss), len(rows))
    assert all(r["memory"] is not None and r["memory"] > 0 for r in rows)
    # the loop's own printed loss and lr, at every step it printed one
    by_step = {r["step"]: r for r in rows}
    for it, (loss, lr) in logged.items():
        assert by_step[it + 1]["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-5), it
        assert by_step[it + 1]["lr"] == pytest.approx(lr, rel=1e-9), it
    assert query_json(cli, proc.pid, "SELECT source, message FROM probe.errors") == []
    # a healthy loop: its every-step memory and data_wait raise neither memory_growth nor input_bound
    doc = doctor(cli, proc.pid)
    assert not [f for f in doc["findings"] if f["rule"] in ("memory_growth", "input_bound")], doc["findings"]


def test_a_leak_is_named_within_a_minute_while_the_budget_measures_few_steps(spawn, cli):
    # given: the loop keeping each micro-step's loss (with its graph) and logits in a list, ~0.4 MB an
    # iteration, under a budget so small that the optional values are measured about once a second
    proc = spawn(
        [NANOGPT, "--leak", "--batch", "48", "--log-every", "1000", "--step-sleep", "0.005"],
        env={"PROBE": "1", "PROBE_STEP_BUDGET": "0.0001"},
    )
    # when / then: the doctor names it within 60 s of the loop's start
    finding, findings = poll_for(cli, proc.pid, "memory_growth", timeout=60)
    assert finding["severity"] == "warning" and "memory in use grows" in finding["message"], finding
    share = query_json(
        cli,
        proc.pid,
        "SELECT avg(measured::INT) AS measured, count(memory) AS with_memory, count(*) AS n FROM torch.steps",
    )[0]
    assert share["measured"] < 0.5, share  # the finding came from every step's memory, not the measured ones
    assert share["with_memory"] >= 0.99 * share["n"], share


def test_two_dataloader_workers_cannot_hide_a_slow_input_pipeline(spawn, cli):
    # given: 10 ms a sample, batch 16, two persistent workers: batches arrive in pairs (a slow step, then a
    # fast one) around a model of about a millisecond
    proc = spawn([TARGETS / "slow_loader.py"], env={"PROBE": "1"}, timeout=120)
    # when / then: the doctor names the input pipeline, judged from every step's data_wait
    finding, _ = poll_for(cli, proc.pid, "input_bound", timeout=90)
    assert "outside forward/backward" in finding["message"] and "the input pipeline" in finding["message"], finding
    rows = query_json(
        cli, proc.pid, "SELECT count(data_wait) AS waited, count(*) AS n FROM torch.steps WHERE step > 2"
    )[0]
    assert rows["waited"] >= 0.99 * rows["n"], rows
