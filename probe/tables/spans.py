"""python.spans: the named spans user code records with ``probe.span``."""

from __future__ import annotations

from .._core import spans
from .registry import Column, table


@table(
    "python.spans",
    "Named spans recorded by user code with `with probe.span(name):` or `@probe.span(name)`, oldest first.",
    columns=[
        Column("name", "VARCHAR", "The span's name, as given to probe.span."),
        Column("step", "BIGINT", "The training step in progress when the span started (1 before the first step ends)."),
        Column("time", "TIMESTAMP", "When the span started."),
        Column("duration", "DOUBLE", "Wall-clock seconds the span lasted."),
        Column("depth", "INTEGER", "Nesting depth on its thread: 0 for an outermost span."),
        Column("parent", "VARCHAR", "Name of the enclosing span on the same thread, NULL for an outermost span."),
        Column("thread_id", "BIGINT", "threading ident of the thread that ran it."),
        Column("thread", "VARCHAR", "Name of that thread."),
        Column("rank", "INTEGER", "Global rank, NULL outside a distributed job."),
    ],
    examples=[
        "SELECT name, COUNT(*) AS n, AVG(duration) AS avg_s, SUM(duration) AS total_s FROM python.spans GROUP BY name "
        "ORDER BY total_s DESC",
        "SELECT s.step, SUM(s.duration) / ANY_VALUE(t.duration) AS data_share FROM python.spans s "
        "JOIN torch.steps t USING (step) WHERE s.name = 'data' GROUP BY s.step ORDER BY s.step DESC LIMIT 10",
    ],
    kind="ring",
)
def spans_table(ctx):
    r = spans.ring()
    if r is None:
        return {name: [] for name in spans.SPAN_COLUMNS}
    return r.snapshot()
