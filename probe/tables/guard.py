"""torch.guard: what the guard (``probe guard``, ``probe.actions.guard``) was armed with and every step it caught."""

from __future__ import annotations

from ..actions.guard import events
from .registry import Column, table

_COLUMNS = (
    "event",
    "step",
    "time",
    "armed",
    "reason",
    "taken",
    "loss",
    "grad_norm",
    "median",
    "first_nonfinite",
    "evidence",
    "optimizer",
)


@table(
    "torch.guard",
    "The guard's events in this process, oldest first: each time it was armed or taken out, and every step it "
    "caught, with what it did and where its evidence is.",
    columns=[
        Column("event", "VARCHAR", "armed, disarmed or trigger."),
        Column(
            "step",
            "BIGINT",
            "The boundary it was armed or taken out at, or the step it caught (the number that step would have had: "
            "a skipped step is not counted, so the next applied step takes it).",
        ),
        Column("time", "TIMESTAMP", "When it happened."),
        Column("armed", "VARCHAR", "What was armed, as `probe guard` flags (--on ... --keep N --skip ...)."),
        Column("reason", "VARCHAR", "What triggered (a trigger's row): non-finite gradients or loss, a spike."),
        Column(
            "taken",
            "VARCHAR",
            "What the guard did: skipped the update, rolled back to the state before step S, or let the step go.",
        ),
        Column("loss", "DOUBLE", "The caught step's loss (NULL on several ranks, where it is not read)."),
        Column("grad_norm", "DOUBLE", "The caught step's total gradient norm, before the update."),
        Column("median", "DOUBLE", "The median gradient norm of the applied steps before it (the spike's base)."),
        Column(
            "first_nonfinite",
            "VARCHAR",
            "On a non-finite catch in a single process, the first module whose output was not finite when the step's "
            "kept batch ran again through the model ('' for the model itself); NULL otherwise.",
        ),
        Column("evidence", "VARCHAR", "The evidence bundle written for it (probe.load_evidence); NULL if none."),
        Column("optimizer", "VARCHAR", "The class of the optimizer whose step was caught."),
    ],
    examples=[
        "SELECT step, reason, taken, evidence FROM torch.guard WHERE event = 'trigger' ORDER BY step",
        "SELECT event, step, armed FROM torch.guard WHERE event <> 'trigger'",
    ],
    kind="ring",
)
def guard_table(ctx):
    return [tuple(e.get(c) for c in _COLUMNS) for e in events()]
