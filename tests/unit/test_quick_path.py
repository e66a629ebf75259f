"""The step tracker's quick path: most boundaries of a fast loop take it, with the exact loss, also when
every step evaluates a closure (Lightning) and when the hang watchdog is armed. In the test process, with the
probe's own optimizer hooks on one optimizer (not torch's global ones, which would outlive the test)."""

from __future__ import annotations

import pytest

from conftest import requires_torch

pytestmark = requires_torch

STEPS = 400


@pytest.fixture
def tracker(monkeypatch):
    """A step tracker fed by the probe's pre- and post-hooks on the optimizer ``hook(opt)`` is given; ``full`` lists
    the steps whose boundary took the full path."""
    import torch

    from probe.training import hooks
    from probe.training.hooks import InputCounter
    from probe.training.steps import StepTracker
    from probe.training.trace import Tracer

    # torch's global hooks, if a probe armed them in this process, would feed this tracker a second time
    assert not hooks._state.get("installed"), "a probe is armed in the test process"
    monkeypatch.setenv("PROBE_STEP_BUDGET", "0.0001")  # few measured steps: the rest may take the quick path
    tracer = Tracer(torch)
    tk = StepTracker(torch, tracer, InputCounter(torch))
    monkeypatch.setitem(hooks._state, "tracker", tk)
    tk.full = []
    boundary = tk.boundary
    tk.boundary = lambda *a, **kw: (tk.full.append(tk.step + 1), boundary(*a, **kw))

    def hook(opt):  # the tracker puts its own pre-hook in while a step needs it (global: out at ``close``)
        opt.register_step_post_hook(tk.on_optimizer_step)

    tk.hook = hook
    try:
        yield tk
    finally:
        tk.close()
        tracer.close()


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(4, 1), torch.randn(8, 4)


def _losses(tk) -> list:
    return [float(v) for v in tk.ring.snapshot()["loss"]]


def test_closure_steps_take_the_quick_path_with_the_closures_loss(tracker):
    import torch

    model, x = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker.hook(opt)
    seen = []

    def closure():  # Lightning's shape: the whole micro-step inside optimizer.step(closure)
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        seen.append(loss.item())
        return loss

    for _ in range(STEPS):
        opt.step(closure)
    assert tracker.step == STEPS
    assert _losses(tracker) == pytest.approx(seen, rel=1e-6)
    assert len(tracker.full) < STEPS // 4, f"{len(tracker.full)} of {STEPS} boundaries were full: {tracker.full[:20]}"


def test_the_hang_watchdog_leaves_the_quick_path_in_place(tracker, monkeypatch, tmp_path):
    import torch

    from probe.agent.watchdog import Watchdog
    from probe.training import boundary

    monkeypatch.setenv("PROBE_HANG_TIMEOUT", "60")
    monkeypatch.setenv("PROBE_RUNTIME_DIR", str(tmp_path))
    dog = Watchdog.start()
    assert dog is not None
    try:
        model, x = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        tracker.hook(opt)
        beat_before = dog.beat_at
        seen = []
        for _ in range(STEPS):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(loss.item())
        assert tracker.step == STEPS and _losses(tracker) == pytest.approx(seen, rel=1e-6)
        assert dog.status()["hang_timeout"] == 60
        # most boundaries were quick ones (nothing runs at every step), and the steps were heard (the full
        # boundaries' heartbeats)
        assert len(tracker.full) < STEPS // 4, f"{len(tracker.full)} of {STEPS} were full: {tracker.full[:20]}"
        assert not boundary.after
        assert dog.beat_at > beat_before
    finally:
        dog.stop()


def test_the_budget_is_not_asked_again_before_it_can_pay_for_the_asking(tracker, monkeypatch):
    """At the default budget on ~1 ms steps, a full boundary that finds the budget short costs more than a step earns:
    asked again as soon as the credit was back to zero, it was short again by its own cost, and every other
    boundary of a fast loop went the full way (1 in 5 here) without measuring anything. It now asks once the credit
    covers that cost too."""
    import time

    import torch

    monkeypatch.setenv("PROBE_STEP_BUDGET", "0.01")
    from probe.training.hooks import InputCounter
    from probe.training.steps import StepTracker
    from probe.training.trace import Tracer

    tk = StepTracker(torch, Tracer(torch), InputCounter(torch))  # the fixture's was built at a budget of 0.0001
    full = []
    boundary = tk.boundary
    tk.boundary = lambda *a, **kw: (full.append(tk.step + 1), boundary(*a, **kw))
    try:
        model, x = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        opt.register_step_post_hook(lambda o, args, kwargs: tk.on_optimizer_step(o))
        for _ in range(STEPS):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.001)  # ok-sleep: a ~1 ms step
        measured = int(tk.ring.snapshot()["measured"].sum())
        # the full boundaries are the measured steps', the ones that tell the next step to measure and a few checks
        assert len(full) <= 3 * measured + 20, f"{len(full)} full boundaries for {measured} measured steps"
    finally:
        tk.close()


def test_the_gradient_watch_looks_at_two_steps_after_a_measured_one_then_costs_no_tensor_operation():
    import torch

    from probe.training.invariants import _WINDOW_STEPS, _GradWatch

    w = torch.nn.Parameter(torch.ones(3))
    taken = [10]  # optimizer steps taken: the watch is armed at step 10's boundary
    watch = _GradWatch(torch, w, "w", 10, lambda: taken[0])
    looked = []
    real_any = torch.Tensor.any
    try:
        torch.Tensor.any = lambda self, *a, **k: (looked.append(1), real_any(self, *a, **k))[1]
        for _ in range(_WINDOW_STEPS + 5):  # one backward per step, zero_grad() before each
            w.grad = None
            (w * 2).sum().backward()
            taken[0] += 1
    finally:
        torch.Tensor.any = real_any
        watch.remove()
    assert watch.until == 10 + _WINDOW_STEPS and watch.fired == _WINDOW_STEPS and watch.clear
    assert len(looked) <= _WINDOW_STEPS  # the steps after the window ran no reduction of the gradient


def test_a_paused_probe_leaves_no_gradient_hook_on_the_model(tracker):
    import torch

    from probe.training import invariants

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker.hook(opt)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        invariants.checks(torch).at_boundary(tracker.step, opt, tracker.capture, lambda: tracker.step)
    checks = invariants.checks(torch)
    assert checks._watch is not None and any(p._backward_hooks for p in model.parameters())
    tracker.close()
    assert checks._watch is None and not any(p._backward_hooks for p in model.parameters())


def test_a_loop_pays_no_pre_hook_until_it_passes_a_closure_and_then_each_step_keeps_its_first_evaluation(tracker):
    import numpy as np
    import torch
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    from probe.util.ring import FLUSH_ROWS

    class Twice(torch.optim.Optimizer):  # plain SGD that evaluates a closure twice, as LBFGS evaluates it again
        def __init__(self, params):
            super().__init__(params, {"lr": 0.01})

        @torch.no_grad()
        def step(self, closure=None):
            if closure is not None:
                with torch.enable_grad():
                    closure()
                    closure()
            for p in self.param_groups[0]["params"]:
                p.add_(p.grad, alpha=-0.01)

    model, x = _model()
    opt = Twice(model.parameters())
    tracker.hook(opt)
    hooked, tails, first = [], [], []  # after each step: whether the pre-hook is in for the next, the ring's tail
    opt.register_step_post_hook(
        lambda o, a, k: (hooked.append(bool(_global_optimizer_pre_hooks)), tails.append(len(tracker.ring.tail)))
    )
    plain = FLUSH_ROWS + 100
    while len(first) < plain or hooked[-1]:  # given: plain steps, more than the ring's tail holds
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        first.append(loss.item())
    # then: the unmeasured ones ran no pre-hook, and the rows of the quick ones reached the ring's columns
    assert sum(hooked) < len(first) // 4, f"the pre-hook was in at {sum(hooked)} of {len(first)} steps"
    assert max(tails) <= FLUSH_ROWS
    snap = tracker.ring.snapshot()
    assert list(snap["step"]) == list(range(1, len(first) + 1))
    quick = ~np.asarray(snap["measured"])
    assert quick.sum() > plain // 2 and not np.asarray(snap["traced"])[quick].any()
    assert (np.asarray(snap["micro_batches"])[quick] == 0).all() and np.ma.getmaskarray(snap["grad_norm"])[quick].all()
    # when: the loop turns to closures, the first on a step with no pre-hook
    evals = [0]

    def closure():
        evals[0] += 1
        loss = model(x).square().mean() * evals[0]  # the second evaluation of a step differs from the first
        opt.zero_grad()
        loss.backward()
        if evals[0] == 1:
            first.append(loss.item())
        return loss

    before = len(hooked)
    for _ in range(50):
        evals[0] = 0
        opt.step(closure)
    # then: every step's loss is its closure's first evaluation, and the pre-hook is in from the next full boundary on
    assert _losses(tracker) == pytest.approx(first, rel=1e-6)
    assert all(hooked[before + 1 :])
