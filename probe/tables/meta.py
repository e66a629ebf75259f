"""probe.tables, probe.columns and probe.errors: the probe describing itself."""

from __future__ import annotations

from ..util.errorlog import error_rows
from .registry import Column, all_tables, table


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
