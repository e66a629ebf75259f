"""The step boundary's registrations: each callback runs where its registration says, ``remove`` undoes any of them,
one that raises leaves the others and training alone, and ``last_step`` follows the boundaries passed. With torch,
a ``before_step`` callback's undo runs right after the optimizer step and names the rate the step's row shows."""

from __future__ import annotations

import threading

import pytest

from conftest import requires_torch


@pytest.fixture
def boundary():
    from probe.training import Boundary

    return Boundary()  # a fresh one: the process's own is left as it was


def test_after_step_and_heartbeats_run_at_every_boundary_passed_until_removed(boundary):
    seen = []
    after, beat = (
        boundary.after_step(lambda e: seen.append(("after", e.step))),
        boundary.heartbeat(lambda step: seen.append(("beat", step))),
    )
    boundary.passed(1)
    boundary.passed(2)
    assert seen == [("after", 1), ("beat", 1), ("after", 2), ("beat", 2)]
    assert boundary.last_step == 2
    boundary.remove(after)
    boundary.remove(beat)
    boundary.passed(3)
    assert len(seen) == 4 and boundary.last_step == 3


def test_a_registration_is_idempotent_and_removing_what_is_not_there_is_harmless(boundary):
    seen = []

    def fn(event):
        seen.append(event.step)

    boundary.after_step(fn)
    boundary.after_step(fn)
    boundary.passed(1)
    boundary.remove(fn)
    boundary.remove(fn)
    boundary.passed(2)
    assert seen == [1]


def test_a_callback_that_raises_is_recorded_and_the_others_still_run(boundary):
    from probe.util.errorlog import error_count, error_rows

    before = error_count()
    seen = []
    boundary.after_step(lambda e: 1 / 0)
    boundary.after_step(lambda e: seen.append(e.step))
    boundary.passed(7)
    assert seen == [7]
    assert error_count() == before + 1 and error_rows()[-1][1].startswith("step subscriber")


def test_before_step_returns_what_runs_right_after_that_optimizer_step(boundary):
    opt_a, opt_b = object(), object()
    order = []

    def before(opt):
        order.append(("before", opt))
        if opt is opt_a:
            return lambda o: order.append(("after", o)) or 0.25

    boundary.before_step(before)
    boundary.optimizer_starts(opt_a)
    boundary.optimizer_starts(opt_b)  # returned nothing: nothing to run after its step
    assert boundary.optimizer_ended(opt_b) is None
    assert boundary.optimizer_ended(opt_a) == 0.25
    assert order == [("before", opt_a), ("before", opt_b), ("after", opt_a)]
    assert not boundary.undo


def test_run_at_next_step_runs_once_on_the_thread_that_passes_the_boundary(boundary):
    ran = []
    got = {}

    def wait():
        got["value"] = boundary.run_at_next_step(lambda: ran.append(threading.get_ident()) or "done", timeout=30)

    waiter = threading.Thread(target=wait)
    waiter.start()
    while not boundary.after:  # registered by the waiting thread
        threading.Event().wait(0.001)
    boundary.passed(1)
    boundary.passed(2)
    waiter.join(30)
    assert got == {"value": "done"} and ran == [threading.get_ident()]
    assert not boundary.after


def test_run_at_next_step_times_out_when_no_boundary_comes(boundary):
    with pytest.raises(TimeoutError):
        boundary.run_at_next_step(lambda: None, timeout=0.01)
    assert not boundary.after


@requires_torch
def test_the_rate_a_before_step_undo_names_is_the_one_torch_steps_shows(monkeypatch):
    import torch

    from probe.training import hooks
    from probe.training import boundary
    from probe.training.hooks import InputCounter
    from probe.training.steps import StepTracker
    from probe.training.trace import Tracer

    assert not hooks._state.get("installed"), "a probe is armed in the test process"
    tracer = Tracer(torch)
    tk = StepTracker(torch, tracer, InputCounter(torch))
    monkeypatch.setitem(hooks._state, "tracker", tk)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_post_hook(tk.on_optimizer_step)
    used = []

    def hold(o):  # what the lr action does: the step runs at 0.05, the loop's 0.1 is back afterwards
        o.param_groups[0]["lr"] = 0.05
        return lambda o: o.param_groups[0].__setitem__("lr", 0.1) or used.append(0.05) or 0.05

    x = torch.randn(8, 4)
    try:
        for held in (False, True, True, False):
            if held:
                boundary.before_step(hold)
            else:
                boundary.remove(hold)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        boundary.remove(hold)
        tk.close()
        tracer.close()
    assert [float(v) for v in tk.ring.snapshot()["lr"]] == [0.1, 0.05, 0.05, 0.1]
    assert opt.param_groups[0]["lr"] == 0.1 and used == [0.05, 0.05]
