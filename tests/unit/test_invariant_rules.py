"""The invariant rules' SQL (cli/doctor/invariants.py) on hand-made torch.checks rows: a finding needs
the last two checks of an invariant failing and that invariant still checked (its last row among the rank's
latest checked steps); a check that stopped (the model it was about is gone) leaves no finding behind."""

from __future__ import annotations

import pytest

from _doctor import rule_rows

COLS = (
    "rank INTEGER, step BIGINT, time DOUBLE, invariant VARCHAR, ok BOOLEAN, "
    "subject VARCHAR, value DOUBLE, detail VARCHAR"
)
RULES = {
    "frozen_params_updated": "frozen_still",
    "params_not_updated": "params_move",
    "scheduler_pace": "schedule",
    "backward_twice": "backward_once",
    "accumulation_erased": "accumulation",
    "grads_not_cleared": "grads_cleared",
    "params_without_grads": "grads_reach",
}


def _checks(invariant, failing_steps, ok_steps=()):
    rows = [(0, s, 0.0, "grads_present", True, "w", None, None) for s in range(1, 21)]
    rows += [(0, s, 0.0, invariant, False, "enc.* (2 tensors)", 2.0, "what broke") for s in failing_steps]
    rows += [(0, s, 0.0, invariant, True, None, 0.0, None) for s in ok_steps]
    return {"torch.checks": (COLS, rows)}


@pytest.mark.parametrize("rule, invariant", RULES.items())
def test_two_failing_checks_at_the_latest_steps_are_a_finding_since_the_first(rule, invariant):
    found = rule_rows(rule, _checks(invariant, [18, 19, 20], ok_steps=[17]))
    assert [(r["step"], r["since"], r["failed"]) for r in found] == [(20, 18, 3)]


@pytest.mark.parametrize("rule, invariant", RULES.items())
def test_one_failing_check_or_a_check_that_stopped_is_none(rule, invariant):
    assert rule_rows(rule, _checks(invariant, [20], ok_steps=[19])) == []
    assert rule_rows(rule, _checks(invariant, [5, 6])) == []  # the rank's checks went on to step 20 without it


def test_grads_reach_names_the_tensors_a_detach_cut_off_and_asks_nothing_of_frozen_ones():
    torch = pytest.importorskip("torch")
    from probe.training.invariants import Invariants

    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"enc": torch.nn.Linear(4, 4), "head": torch.nn.Linear(4, 2), "frozen": torch.nn.Linear(4, 4)}
    )
    model["frozen"].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checks = Invariants(torch)
    checks._names = {id(p): name for name, p in model.named_parameters()}
    x = torch.randn(3, 4)
    for step, cut in ((1, False), (2, True)):
        opt.zero_grad(set_to_none=True)
        h = model["enc"](model["frozen"](x))
        model["head"](h.detach() if cut else h).sum().backward()
        checks._grads_reach(step, 0.0, opt)
    rows = checks.snapshot()
    assert list(rows["ok"]) == [True, False]
    assert rows["subject"][1] == "enc.* (2 tensors)" and rows["value"][1] == 2.0, rows["subject"][1]
    assert rows["detail"][1] == "2 of the 4 trainable tensors held no gradient at the step"
