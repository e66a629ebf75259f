"""The gradient-norm budget's arithmetic, over simulated time (the budget's doctests are in
tests/unit/test_doctests.py; a real job's budget is tests/training/test_torch_budget.py)."""

from __future__ import annotations

from conftest import requires_torch

pytestmark = requires_torch


def test_an_expensive_gradient_norm_stays_within_its_share():
    """A large model's norm on CPU (11 ms every 145 ms step) at PROBE_GRAD_NORM's 0.1 %: the norm budget
    the tracker uses must run it about share * time / cost times, not every few steps (a capped charge
    or a one-second debt floor made it run on 2 steps in 3: 5 % of the step time)."""
    from probe.training.steps import norm_budget

    b = norm_budget()
    share, burst = b.share, b.cap
    assert share == 0.001  # the default
    now, runs = 0, 0
    for _ in range(1000):  # 145 s of training
        now += 145_000_000
        b.earn(145_000_000)
        if b.allows(now):
            runs += 1
            b.spend(11_000_000)
    # what it spent: at most the share of the time, plus the starting credit and one norm
    assert runs * 11_000_000 <= share * 145e9 + burst + 11_000_000, runs
    assert runs >= 10  # and it does run
