"""Running the REPL's SQL: one statement at a time, cancellable with Ctrl-C.

A query runs on a worker thread (snapshots from the target, then DuckDB here in the
REPL) while the main thread waits; Ctrl-C there interrupts this process's own DuckDB
(or abandons the snapshot request), and the session goes on. The target never runs
the query, so there is nothing to cancel there. ``split_statements`` cuts the input at the
semicolons sqlglot's tokenizer sees (a ';' inside a string does not count).
"""

from __future__ import annotations

import threading
import time
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
            out.append(text[start : t.start])
            start = t.end + 1
    out.append(text[start:])
    return [s.strip() for s in out if s.strip()]


def is_complete(text: str) -> bool:
    """Whether Enter should run the input: empty, a special command, or SQL ending with ';'."""
    stripped = text.strip()
    return (
        not stripped
        or stripped.startswith("\\")
        or stripped.endswith(";")
        or stripped.lower() in ("quit", "exit", "help")
    )


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
        from ..query_runner import federated_query

        s = self.session
        targets = None if s.multi else [s.target()]
        holder: list = []

        def cancel() -> bool:
            """Interrupt DuckDB when the query reached it (True); else the snapshot request is abandoned."""
            if holder:
                holder[-1].interrupt()  # the latest workspace (a query planned again has a second one)
            return bool(holder)

        return self._wait(lambda: federated_query(s, sql, targets=targets, on_workspace=holder.append), cancel)

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
        in_duckdb = cancel()
        if in_duckdb:
            worker.join(2.0)
        where = (
            "stopped in this session's DuckDB"
            if in_duckdb
            else "abandoned while the snapshot was on its way (the process answers it and moves on)"
        )
        raise Cancelled(f"cancelled after {waited:.1f} s; the query was {where}.")
