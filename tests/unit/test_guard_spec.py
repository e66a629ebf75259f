"""The guard's settings and values without a training process: what ``--on``/PROBE_GUARD parse to, the one-sentence
refusals, the medians a spike is measured against, and the host copies kept for the evidence."""

from __future__ import annotations

import pytest

from probe import ActionError
from probe.actions.evidence import host_copy, median
from probe.actions.guard import parse_spec


def test_probe_guard_and_the_command_fields_parse_to_the_same_spec():
    from_setting = parse_spec("nonfinite,spike=50,keep=2,skip,rollback,evidence=/tmp/g")
    from_fields = parse_spec("nonfinite,spike=50", keep=2, skip=True, rollback=True, evidence="/tmp/g")
    assert from_setting == from_fields
    assert from_fields.describe() == "--on nonfinite,spike=50 --keep 2 --skip --rollback --evidence /tmp/g"
    assert parse_spec(None).describe() == "--on nonfinite --keep 1"
    assert parse_spec("loss=3.5").describe() == "--on loss=3.5 --keep 1"  # a ratio alone arms no nonfinite


@pytest.mark.parametrize(
    "on, keep, message",
    [
        ("spike=1", 1, "spike=1: give a ratio above 1, e.g. spike=50."),
        ("spike=nan", 1, "spike=nan: give a ratio above 1, e.g. spike=50."),
        ("loss=-3", 1, "loss=-3: give a ratio above 1, e.g. loss=50."),
        ("nonfinite,often", 1, "unknown trigger 'often'; give nonfinite, spike=N or loss=N, comma-separated."),
        ("nonfinite", 65, "--keep takes a whole number of steps from 0 to 64."),
    ],
)
def test_bad_fields_are_refused_in_one_sentence(on, keep, message):
    with pytest.raises(ActionError) as caught:
        parse_spec(on, keep=keep)
    assert caught.value.message == message


def test_the_median_needs_enough_steps():
    assert median([3.0] * 9, 10) is None
    assert median([1.0, 5.0, 2.0, 4.0] * 3, 10) == 3.0


def test_host_copies_are_detached_and_counted():
    torch = pytest.importorskip("torch")
    x = torch.ones(4, 2, requires_grad=True) * 2
    (args, kwargs), size = host_copy(
        torch, ((x,), {"labels": torch.zeros(4, dtype=torch.long), "flag": True, "o": object()})
    )
    assert size == 4 * 2 * 4 + 4 * 8
    assert not args[0].requires_grad and args[0].data_ptr() != x.data_ptr()
    assert kwargs["flag"] is True and kwargs["o"] == "<object>"
