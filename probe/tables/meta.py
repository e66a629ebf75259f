"""The probe describing itself: its tables and columns (``probe.tables``, ``probe.columns``), its own errors
(``probe.errors``), and every guarded action of this process and what became of it (``probe.actions``).
"""

from __future__ import annotations

import json

from ..util.errorlog import error_rows
from .registry import Column, all_tables, table
from ..actions.queue import actions


@table(
    "probe.tables",
    "Every table this probe serves, with its description.",
    columns=[
        Column("name", "VARCHAR", "Full name, schema.table."),
        Column("schema", "VARCHAR", "Schema part of the name."),
        Column("table_name", "VARCHAR", "Table part of the name."),
        Column(
            "kind",
            "VARCHAR",
            "snapshot (built at query time), ring (a ring buffer filled by hooks) or client (computed by the probe "
            "CLI, e.g. diagnosis.findings).",
        ),
        Column("description", "VARCHAR", "What one row is."),
        Column("columns", "INTEGER", "Number of columns."),
    ],
    examples=["SELECT name, description FROM probe.tables ORDER BY name"],
)
def tables(ctx):
    return [(t.name, t.schema, t.short, t.kind, t.description, len(t.columns)) for t in all_tables()]


@table(
    "probe.columns",
    "Every column of every table, with its type and description.",
    columns=[
        Column("table_name", "VARCHAR", "Full table name, schema.table."),
        Column("column_name", "VARCHAR", "Column name."),
        Column("position", "INTEGER", "Position of the column in the table, from 1."),
        Column("type", "VARCHAR", "DuckDB type of the column."),
        Column("description", "VARCHAR", "What the column holds."),
    ],
    examples=["SELECT column_name, type FROM probe.columns WHERE table_name = 'python.backtrace'"],
)
def columns(ctx):
    return [(t.name, c.name, i + 1, c.type, c.description) for t in all_tables() for i, c in enumerate(t.columns)]


@table(
    "probe.errors",
    "Errors caught inside the probe (hooks, collectors, requests); training went on after each.",
    columns=[
        Column("time", "TIMESTAMP", "When the error was caught."),
        Column("source", "VARCHAR", "Which part of the probe caught it."),
        Column("error_type", "VARCHAR", "Exception class name."),
        Column("message", "VARCHAR", "Exception message."),
        Column("traceback", "VARCHAR", "Formatted traceback, innermost call last."),
        Column("thread", "VARCHAR", "Thread the error happened on."),
    ],
    examples=["SELECT source, COUNT(*) AS n FROM probe.errors GROUP BY source ORDER BY n DESC"],
    kind="ring",
)
def errors(ctx):
    return error_rows()


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
    return [dict(vars(a), args=_json(a.args), client=_json(a.client), result=_json(a.result)) for a in actions()]
