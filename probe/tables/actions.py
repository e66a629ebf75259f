"""probe.actions: every guarded action of this process and what became of it."""

from __future__ import annotations

import json

from ..actions.queue import actions
from .registry import Column, table


def _json(value) -> str | None:
    if value is None:
        return None
    try:
        return json.dumps(value, default=repr)
    except Exception:
        return repr(value)


@table(
    "probe.actions",
    "Guarded actions (eval, checkpoint, lr, cleanup, debug) sent to this process, newest last.",
    columns=[
        Column("id", "BIGINT", "Action id, unique within the process."),
        Column("command", "VARCHAR", "eval, checkpoint, lr, cleanup or debug."),
        Column("state", "VARCHAR", "queued, running, done, failed, timed_out or cancelled."),
        Column("args", "VARCHAR", "The arguments as JSON."),
        Column(
            "client",
            "VARCHAR",
            "Who asked: unix uid or TCP address, as JSON, with agent set when a program asked for the user (mcp for "
            "`probe mcp`).",
        ),
        Column("now", "BOOLEAN", "True when it ran at once on the server thread instead of at a step boundary."),
        Column(
            "at_step",
            "BIGINT",
            "The step it was asked to run at (every rank asked alike): it runs at that step's safe point or, if the "
            "step had passed, fails without running.",
        ),
        Column("requested_at", "TIMESTAMP", "When the request arrived."),
        Column("started_at", "TIMESTAMP", "When it started running; NULL if it never did."),
        Column("finished_at", "TIMESTAMP", "When it ended (done, failed or timed out)."),
        Column("step", "BIGINT", "The step boundary it ran at; NULL for --now before the first step."),
        Column("result", "VARCHAR", "What it returned, as JSON."),
        Column("error", "VARCHAR", "Why it failed or timed out."),
    ],
    examples=[
        "SELECT id, command, state, step, error FROM probe.actions ORDER BY id",
        "SELECT command, state, COUNT(*) AS n FROM probe.actions GROUP BY ALL",
        "SELECT id, finished_at - started_at AS took FROM probe.actions WHERE state = 'done'",
    ],
    kind="ring",
)
def actions_table(ctx):
    return [
        (
            a.id,
            a.command,
            a.state,
            _json(a.args),
            _json(a.client),
            a.now,
            a.at_step,
            a.requested_at,
            a.started_at,
            a.finished_at,
            a.step,
            _json(a.result),
            a.error,
        )
        for a in actions()
    ]
