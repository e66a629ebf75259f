"""The invariant rules' SQL (probe/diagnosis/invariant_rules.py) on hand-made torch.checks rows: a finding needs
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
