"""Running the REPL's SQL: one statement at a time, cancellable with Ctrl-C.

A query is sent from a worker thread with a fresh ``query_id`` while the main thread
waits; Ctrl-C there posts ``/query/cancel`` with that id, which interrupts DuckDB in
the target, and the session goes on. ``split_statements`` cuts the input at the
semicolons sqlglot's tokenizer sees (a ';' inside a string does not count).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

from probe._errors import EndpointError, ProbeError

__all__ = ["Cancelled", "Executor", "split_statements", "is_complete", "describe_error"]


class Cancelled(Exception):
    """The user pressed Ctrl-C while a query ran."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass
class _Outcome:
    result: object = None
    error: BaseException | None = None


def split_statements(text: str) -> list[str]:
    """The statements of ``text``, each without its trailing ';'."""
    from sqlglot.errors import TokenError
    from sqlglot.tokens import Tokenizer

    try:
        tokens = Tokenizer().tokenize(text)
    except TokenError:
        return [text.strip().rstrip(";").strip()] if text.strip().rstrip(";").strip() else []
    out, start = [], 0
    for t in tokens:
        if t.token_type.name == "SEMICOLON":
            out.append(text[start:t.start])
            start = t.end + 1
    out.append(text[start:])
    return [s.strip() for s in out if s.strip()]


def is_complete(text: str) -> bool:
    """Whether Enter should run the input: empty, a special command, or SQL ending with ';'."""
    stripped = text.strip()
    return (not stripped or stripped.startswith("\\") or stripped.endswith(";")
            or stripped.lower() in ("quit", "exit", "help"))


def describe_error(exc: ProbeError, sql: str | None = None) -> str:
    """The error's sentence, and for SQL with a line/column the offending line with a caret."""
    text = f"error: {exc.message}"
    line, col = getattr(exc, "line", None), getattr(exc, "col", None)
    if sql and line and col:
        lines = sql.splitlines()
        if 0 < line <= len(lines):
            text += f"\n  {lines[line - 1]}\n  {' ' * max(col - 1, 0)}^"
    return text


class Executor:
    """Runs SQL for a ``ReplSession`` on its current target(s)."""

    def __init__(self, session):
        self.session = session

    def query(self, sql: str):
        """The Result of ``sql``; raises ProbeError, or Cancelled on Ctrl-C."""
        s = self.session
        if s.multi:
            return self._wait(lambda: self._federated(sql), None)
        from probe.sql.engine import Result

        target = s.target()
        query_id = uuid.uuid4().hex
        body = {"sql": sql, "timeout": s.timeout, "query_id": query_id}
        return self._wait(lambda: Result.from_dict(s.client(target).post("/query", body, timeout=s.timeout + 5)),
                          lambda: s.client(target).post("/query/cancel", {"query_id": query_id}, timeout=2.0))

    def _federated(self, sql: str):
        from .._federation import federated_query

        return federated_query(self.session, sql)

    def _wait(self, work, cancel):
        outcome = _Outcome()

        def run():
            try:
                outcome.result = work()
            except BaseException as exc:  # handed to the main thread
                outcome.error = exc

        worker = threading.Thread(target=run, name="probe-repl-query", daemon=True)
        started = time.monotonic()
        worker.start()
        try:
            while worker.is_alive():
                worker.join(0.05)
        except KeyboardInterrupt:
            return self._cancel(worker, cancel, started)
        if outcome.error is not None:
            if isinstance(outcome.error, EndpointError):
                self.session.gone = True
            raise outcome.error
        return outcome.result

    def _cancel(self, worker, cancel, started):
        waited = time.monotonic() - started
        if cancel is None:
            raise Cancelled(f"cancelled after {waited:.1f} s; the ranks stop their part at their query timeout.")
        try:
            doc = cancel()
        except ProbeError as exc:
            raise Cancelled(f"cancelled here after {waited:.1f} s, but the target did not confirm ({exc.message}); it stops the query at its timeout.") from None
        worker.join(2.0)
        where = "stopped in the target" if doc.get("cancelled") else "stopped before it reached DuckDB"
        raise Cancelled(f"cancelled after {waited:.1f} s; the query was {where}.")
