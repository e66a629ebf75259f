"""What the probe adds to an unmeasured step, counted rather than timed: the calls on the training thread of a
loop written as others write them (3 Linear layers, in-place ReLU, Adam, StepLR, cross-entropy), probe running
against paused, in one process. A count does not move with the machine's load, so it holds the per-step cost
(docs/torch.md, Cost) where a step-time ratio on a shared host cannot."""

from __future__ import annotations

import json

from conftest import TARGETS, requires_torch, run_target

pytestmark = requires_torch

# Calls the probe adds to an unmeasured step: the post-hook's quick boundary with its row (7: the hook, two clock
# reads, the lead optimizer's id, the step's one loss taken off its list, the row onto the ring's tail), the backward
# wrapper with the loss's read (3), the root model's call clock (3: torch.compiler.is_dynamo_compiling, so that a
# compiled function calling the model traces none of it); no optimizer pre-hook (a loop whose closures, if any, are
# evaluated once needs none). One more is a call paid on every step of every probed job.
ADDED_CALLS = 13


def test_an_unmeasured_step_adds_no_more_calls_than_the_quick_path_needs_and_keeps_its_core_signals(probe_env):
    # given: the loop, its measured steps few (the budget's one-second floor only)
    env = dict(probe_env, PROBE_STEP_BUDGET="0.0001")
    # when: it counts the calls of each step with the probe running, paused, then resumed
    out = run_target([TARGETS / "step_calls.py", "--warmup", "300", "--steps", "300"], env, timeout=300)
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    # then: most steps are unmeasured, so the medians are an unmeasured step's
    assert counts["steps"] == 300 and counts["measured"] < 150, counts
    # and: the probe adds at most ADDED_CALLS calls to such a step, the same before a pause and after it
    assert counts["on"] - counts["off"] <= ADDED_CALLS, counts
    assert counts["resumed"] == counts["on"], counts
    # and: every step after the resume still has its loss and its data wait (the root model is hooked again)
    assert counts["with_loss"] == counts["with_data_wait"] == 300, counts
    # and: the model the probe clocks still copies and pickles
    assert counts["copies"] is True, counts
