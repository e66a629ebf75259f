"""PROBE_STEP_BUDGET: the probe's per-step work stays within a share of step time by measuring
the optional values (loss, grad norm, peak memory) on a subset of steps; step count, step
times and actions stay exact, and ``measured`` tells a value not measured from a missing one."""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from conftest import TARGETS, poll, requires_torch
from harness import query_json

pytestmark = requires_torch
LOOP = TARGETS / "budget_loop.py"
FAST, SLOW = 300, 30  # steps of the measured run of each job


def at(ts) -> datetime:
    return datetime.fromisoformat(str(ts))


def loop_losses(proc) -> list[float]:
    return [float(v) for v in next(line for line in proc.lines if line.startswith("losses ")).split()[1:]]


@pytest.fixture(scope="module")
def tiny(shared_spawn):
    """Fast steps under a budget far below the probe's fixed cost: almost every step goes unmeasured."""
    return shared_spawn([LOOP, "--steps", str(FAST)], env={"PROBE_STEP_BUDGET": "0.0001"})


@pytest.fixture(scope="module")
def slow(shared_spawn):
    """20 ms steps under the default budget (1 % = 200 us per step): every step fits."""
    return shared_spawn([LOOP, "--steps", str(SLOW), "--step-sleep", "0.02"], ready=None)


def test_tiny_budget_keeps_count_and_times_exact_and_flags_unmeasured_steps(tiny, shared_cli):
    rows = query_json(
        shared_cli,
        tiny.pid,
        "SELECT step, started_at, ended_at, duration, loss, grad_norm, peak_allocated, memory, "
        "samples, micro_batches, lr, optimizer, measured, probe_us "
        f"FROM torch.steps WHERE step <= {FAST} ORDER BY step",
    )
    # step count exact: one row per optimizer step, none missing
    assert [r["step"] for r in rows] == list(range(1, FAST + 1))
    # step times exact: every step has its duration, and each starts where the previous one ended
    assert all(r["duration"] > 0 and r["probe_us"] > 0 for r in rows)
    gaps = [abs((at(b["started_at"]) - at(a["ended_at"])).total_seconds()) for a, b in zip(rows, rows[1:])]
    assert max(gaps) <= 2e-6  # TIMESTAMP keeps microseconds
    # the start-up steps are measured; most of the others are not (the budget is tiny)
    assert all(r["measured"] for r in rows[:3])
    unmeasured = [r for r in rows if not r["measured"]]
    assert len(unmeasured) > FAST // 2
    # not measured: NULL, never a stale or made-up value
    assert all(r["grad_norm"] is None for r in unmeasured)
    # the inputs are counted on measured steps only (the model's input hook is in for those steps alone)
    assert all(r["samples"] is None and r["micro_batches"] == 0 for r in unmeasured)
    # the core signals are there on every step, measured or not: lr, the loop's own loss, memory
    assert all(r["lr"] == pytest.approx(0.05) and r["optimizer"] == "SGD" for r in rows)
    losses = loop_losses(tiny)
    assert [r["loss"] for r in rows] == pytest.approx(losses[:FAST], rel=1e-6)
    assert all(r["peak_allocated"] > 0 and r["memory"] > 0 for r in rows)
    measured = [r for r in rows if r["measured"]]
    assert all(r["samples"] == 16 and r["micro_batches"] == 1 for r in measured if r["step"] > 1)  # found at step 1


def test_a_starved_budget_still_measures_a_step_every_second(tiny, shared_cli):
    # given: the tiny budget's job stepping every 5 ms after its measured run (the fixed part alone exceeds
    # the budget, so the quick path runs until the one-second floor comes round)
    def three_measured() -> list:
        rows = query_json(
            shared_cli, tiny.pid, f"SELECT step, ended_at, measured FROM torch.steps WHERE step > {FAST} ORDER BY step"
        )
        return rows if sum(r["measured"] for r in rows[1:]) >= 3 else []

    rows = poll(three_measured, 90, interval=0.5)  # the job needs wall time to pass
    # then: measured steps keep coming, each allowed once the floor came round: boundary n, which allows step
    # n + 1, ends a second or more after the boundary that allowed the last measured step, and at most a few
    # boundaries after the first that did (the jitter puts a due step off by a coin toss a boundary, so that
    # measured steps cannot follow the job's own period; 40 tails in a row would be a 1e-12 chance). Read from
    # the rows' own times and counts, so a loaded host that stretches the steps changes nothing.
    measured = [i for i, r in enumerate(rows) if r["measured"] and i > 0]
    assert len(measured) >= 3, rows[-5:]
    end = [at(r["ended_at"]) for r in rows]
    for a, b in zip(measured, measured[1:]):
        allowed_at, allowed = end[a - 1], b - 1  # the boundaries that allowed step a and step b
        assert (end[allowed] - allowed_at).total_seconds() >= 1.0 - 2e-6, rows[a - 1 : b + 1]
        due = next(i for i in range(a, b) if (end[i] - allowed_at).total_seconds() >= 1.0 - 2e-6)
        assert allowed - due <= 40, rows[a - 1 : b + 1]


def test_lr_action_takes_effect_at_the_next_step_under_sampling(tiny, shared_cli):
    # when: an lr change while almost no step is measured
    r = shared_cli(tiny.pid, "lr", "--set", "0.0123")
    assert r.returncode == 0, r.stderr
    first = int(re.search(r"from step (\d+)", r.stdout).group(1))

    # then: every step from the next one on used it, measured or not
    def twenty_steps() -> list:  # the loop steps every 5 ms
        rows = query_json(
            shared_cli, tiny.pid, f"SELECT step, lr, measured FROM torch.steps WHERE step >= {first} ORDER BY step"
        )
        return rows if len(rows) >= 20 and any(not x["measured"] for x in rows) else []

    rows = poll(twenty_steps, 60)
    assert len(rows) >= 20 and any(not x["measured"] for x in rows)
    assert all(x["lr"] == pytest.approx(0.0123) for x in rows)
    before = query_json(shared_cli, tiny.pid, f"SELECT lr FROM torch.steps WHERE step = {first - 1}")
    assert before[0]["lr"] == pytest.approx(0.05)


def replay_step_budget(rows) -> tuple[list[bool], list[float]]:
    """The step budget's decisions, replayed from the rows' own accounting with the product's Budget: each
    boundary pays the previous one's ``probe_us`` (times the charge), earns its step's ``duration`` and says
    whether the next step is measured; a measured traced step also pays what its hooks added to the step.
    Returns whether each row's step should be measured and the credit (ns) that decided it. Exact while every
    step takes the full path, i.e. up to the first step the budget leaves unmeasured (the quick path after it
    settles several boundaries at once)."""
    from probe.config import setting
    from probe.training.steps import _CHARGE, _FORCED, _MAX_GAP_S
    from probe.util.budget import Budget

    budget = Budget(setting("PROBE_STEP_BUDGET"), max_gap_s=_MAX_GAP_S)
    first_end = at(rows[0]["ended_at"])
    expected, credit = [True], [budget.credit]
    spent, typical = 0.0, 0.0
    for r in rows:
        now_ns = 10**12 + int((at(r["ended_at"]) - first_end).total_seconds() * 1e9)  # perf_counter_ns is far from 0
        duration_ns = r["duration"] * 1e9
        allowed = budget.tick(duration_ns, now_ns, spent, 1)
        expected.append(allowed or r["step"] + 1 <= _FORCED)
        credit.append(budget.credit)
        if r[
            "measured"
        ]:  # what a measured step does after deciding: charge a traced step's hooks, learn the typical step
            if r["traced"]:
                if typical > 0 and duration_ns > typical:
                    budget.spend(duration_ns - typical)
            elif typical > 0:
                typical += (duration_ns - typical) * 0.125
            else:
                typical = duration_ns
        spent = _CHARGE * r["probe_us"] * 1e3 if r["step"] > _FORCED else 0.0
    return expected[: len(rows)], credit[: len(rows)]


def test_default_budget_measures_slow_steps_while_its_own_accounting_has_credit(slow, shared_cli):
    """20 ms steps under the default budget (1 %: 200 us a step, 10 ms of starting credit): every step fits
    unless the probe's own boundaries cost more than that, which a loaded host can make them. The test reads
    the budget's own accounting (each row's probe_us and duration) rather than assuming how fast the machine
    is: each step is measured exactly when the replayed budget had credit for it."""
    slow.wait_for("ready", timeout=90)
    rows = query_json(
        shared_cli,
        slow.pid,
        f"SELECT step, ended_at, loss, measured, traced, probe_us, duration FROM torch.steps "
        f"WHERE step <= {SLOW} ORDER BY step",
    )
    assert [r["step"] for r in rows] == list(range(1, SLOW + 1))
    assert all(r["measured"] for r in rows[:3])  # start-up steps always are
    expected, credit = replay_step_budget(rows)
    # up to the first step the budget had no credit for, the decisions are the replay's; a credit within 1 us of
    # zero is left out (the rows keep probe_us to the nanosecond, duration to a double's precision)
    first_short = next((i for i, ok in enumerate(expected) if not ok), len(rows))
    for r, ok, c in list(zip(rows, expected, credit))[: first_short + 1]:
        if abs(c) > 1e3:
            assert r["measured"] == ok, (r, ok, c, rows)
    # on a machine where the probe's boundaries fit the share (the usual case), that is every step
    if first_short == len(rows):
        assert all(r["measured"] for r in rows)
    # measured: the loop's own loss
    losses = loop_losses(slow)
    assert [r["loss"] for r in rows if r["measured"]] == pytest.approx(
        [losses[r["step"] - 1] for r in rows if r["measured"]], rel=1e-6
    )
