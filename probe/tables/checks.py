"""torch.checks: the invariant checks of training (``probe.training.invariants``), one row per check per measured
step."""

from __future__ import annotations

from ..training.invariants import CHECK_COLUMNS, checks as _checks
from .registry import Column, table


@table(
    "torch.checks",
    "Invariants of training checked on measured steps (gradients present at the step and cleared between steps, "
    "accumulation kept, one backward per loss, parameters that move and frozen ones that do not, the scheduler's pace, "
    "dropout and batch norm in training mode), one row per check and step, ok or not, naming what it is about.",
    columns=[
        Column("step", "BIGINT", "The measured step at whose boundary the check was made."),
        Column("time", "TIMESTAMP", "When it was made."),
        Column(
            "invariant",
            "VARCHAR",
            "grads_present (the lead optimizer's step found gradients), grads_reach (every trainable tensor it holds "
            "got one, when any did), grads_cleared (a tensor's gradient was None or "
            "zero at some backward since the last measured step), accumulation (with more backward passes than "
            "optimizer steps, the gradient was not cleared before every one), backward_once (no loss graph "
            "backpropagated twice in the step), params_move (sampled trainable tensors with a gradient and a learning "
            "rate changed), frozen_still (sampled frozen tensors an optimizer holds did not change), schedule (the "
            "lead optimizer's scheduler kept its declared pace), or train_mode (dropout and batch-norm modules in "
            "training mode).",
        ),
        Column("ok", "BOOLEAN", "Whether the invariant held."),
        Column(
            "subject",
            "VARCHAR",
            "What the check is about, by name: the parameter watched (grads_cleared, grads_present, accumulation), the "
            "tensors that broke it grouped by module prefix (params_move, frozen_still, grads_reach), the scheduler "
            "class (schedule), the repeated graph's node (backward_once), or the modules found in eval mode "
            "(train_mode).",
        ),
        Column(
            "value",
            "DOUBLE",
            "grads_cleared: backward passes seen; grads_reach: tensors without a gradient; grads_present: trainable "
            "tensors of the optimizer when none held a "
            "gradient (NULL when ok); accumulation: backward passes per optimizer step; backward_once: backward calls "
            "in the step; params_move, frozen_still: tensors that broke it; schedule: scheduler steps per optimizer "
            "step; train_mode: modules in eval mode.",
        ),
        Column("detail", "VARCHAR", "The evidence in words, NULL when there is nothing to add."),
    ],
    examples=[
        "SELECT step, invariant, ok, subject, detail FROM torch.checks ORDER BY step DESC, invariant LIMIT 10",
        "SELECT invariant, COUNT(*) AS checks, COUNT(*) FILTER (WHERE NOT ok) AS failed FROM torch.checks GROUP BY "
        "invariant",
    ],
    kind="ring",
)
def checks_table(ctx):
    inv = _checks()
    if inv is None:
        return {name: [] for name in CHECK_COLUMNS}
    return inv.snapshot()
