"""`probe doctor` names each planted fault of the model, its gradients, its optimizer and its loss
(tests/targets/faults.py, PROBE=1, no probe code).

The catalog (tests/targets/fault_catalog.py) is split between two files only so that the test
workers run them side by side; each fault job is its own process either way.
"""

from __future__ import annotations

import pytest

from _doctor import names_the_planted_fault
from conftest import requires_torch
from targets.fault_catalog import FAULTS, MODEL_FAULTS

SELECTED = [f for f in FAULTS if f[0] in MODEL_FAULTS]


@requires_torch
@pytest.mark.parametrize("fault, rule, words", SELECTED, ids=[f[0] for f in SELECTED])
def test_doctor_names_the_planted_fault(spawn, cli, fault, rule, words):
    names_the_planted_fault(spawn, cli, fault, rule, words, human=fault == SELECTED[0][0])
