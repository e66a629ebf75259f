"""Dead processes as targets: a pid or a rank that died answers from its post-mortem record.

``cli.plumbing.endpoint`` turns a dead pid with a record, or a dead rank of a job, into a Target
(``entry["postmortem"]`` holds the record's folder, ``target.record`` the
``probe.postmortem.reader.Record``). ``Session.client`` hands such a target a :class:`RecordClient`, which answers
the read routes the commands use (``/health``, ``/tables``, ``/backtrace``, the snapshot
of ``/snapshot``) from ``probe.postmortem.reader``, so ``query``, ``status``, ``doctor``,
``tables``, ``describe`` and ``backtrace`` run their usual path, DuckDB here, unchanged.
Anything else (actions, eval, profiles) gets one sentence: the process is gone.
"""

from __future__ import annotations

from probe._errors import EndpointError, QueryError

__all__ = ["RecordClient", "is_postmortem", "refine_refusal"]


def is_postmortem(target) -> bool:
    """Whether ``target`` is a dead process answered by its post-mortem record."""
    return getattr(target, "record", None) is not None


def refine_refusal(exc: QueryError, targets) -> QueryError:
    """A query refused on one dead process's record: say which tables its record keeps."""
    if len(targets) != 1 or not is_postmortem(targets[0]) or not exc.table:
        return exc
    rec = targets[0].record
    return QueryError(
        f"{rec.describe()}; its post-mortem record keeps {', '.join(rec.stored) or 'no tables'} "
        f"(and the ranks.* views), not {exc.table}.",
        table=exc.table,
    )


class RecordClient:
    """The client of a dead process: the read routes answered from its record."""

    def __init__(self, target, timeout: float = 10.0, agent: str | None = None):
        self.target = target
        self.record = target.record
        self.timeout = timeout

    def get(self, path: str, timeout: float | None = None, **params) -> dict:
        route = path.split("?", 1)[0]
        if route == "/health":
            return self.record.health()
        if route == "/tables":
            return self.record.tables_doc()
        if route == "/backtrace":
            return self.record.backtrace_doc(params.get("thread"))
        return self._gone(route)

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        return self._gone(path)

    def request(
        self, method: str, path: str, body: dict | None = None, timeout: float | None = None, raw: bool = False
    ):
        if method == "GET" and body is None:
            return self.get(path, timeout)
        return self._gone(path)

    def snapshot(self, tables: dict, timeout: float) -> dict:
        return self.record.snapshot(tables)

    def _gone(self, route: str):
        raise EndpointError(
            f"{self.record.describe()}; its post-mortem record answers only read commands "
            f"(query, tables, describe, backtrace, status, doctor), not {route}."
        )
