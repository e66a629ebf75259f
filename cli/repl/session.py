"""What the REPL is connected to, what it knows about it, and how its SQL runs.

``ReplSession`` is the CLI's ``Session`` with a switchable target: the commands the
REPL reuses (``backtrace``, ``lr``, ``checkpoint``...) call ``session.target()`` and
get the rank the user switched to with ``\\rank N``. ``Background`` refreshes the
schema (for completion) and the target's ``GET /health`` (for the toolbar) on a
daemon thread, so the prompt never waits on the network.

``Executor`` runs one statement at a time on a worker thread while the main thread waits, so Ctrl-C
cancels it as docs/repl.md says. ``split_statements`` cuts the input at the semicolons sqlglot's
tokenizer sees (a ';' inside a string does not count).
"""

from __future__ import annotations

import argparse
import copy
import threading
import time
from dataclasses import dataclass

from probe._errors import EndpointError, ProbeError

from ..plumbing.session import Session
from .completer import Schema, SqlCompleter, duckdb_function_names


class ReplSession(Session):
    """A CLI session whose target the user switches: one endpoint, one rank, or all ranks."""

    def __init__(self, args):
        super().__init__(args)
        self.expanded = False
        self.timing = False
        self.gone = False
        if getattr(args, "ranks", None):
            self.spec = ("ranks", args.ranks)
        elif getattr(args, "rank", None) is not None:
            self.spec = ("rank", args.rank)
        else:
            self.spec = ("endpoint", args.endpoint)
        self._targets = []

    # -- targets -------------------------------------------------------------------
    def connect(self, spec=None) -> None:
        """Resolve ``spec`` (kind, value) to targets; raises ProbeError with the reason."""
        from ..plumbing.endpoint import parse_rank_spec, resolve, targets_for_ranks

        kind, value = spec or self.spec
        if kind == "ranks":
            targets = targets_for_ranks(parse_rank_spec(str(value)), self.token, getattr(self.args, "job", None))
        elif kind == "rank":
            targets = targets_for_ranks([int(value)], self.token, getattr(self.args, "job", None))
        else:
            if not value:
                raise ProbeError(
                    "the REPL needs a process: `probe ENDPOINT` with a pid, host:port or socket (see `probe list`), or "
                    "--rank N."
                )
            targets = [resolve(str(value), self.token)]
        if len(targets) == 1 and targets[0].entry.get("missing"):
            raise ProbeError(targets[0].entry.get("hint") or f"{targets[0].label} has no probe server.")
        self.spec, self._targets, self.gone = (kind, value), targets, False
        args = copy.copy(self.args)
        args.endpoint, args.rank, args.ranks = None, None, None
        if kind == "ranks":
            args.ranks = str(value)
        self.args = args

    @property
    def multi(self) -> bool:
        return self.spec[0] == "ranks"

    def target(self):
        if not self._targets:
            raise ProbeError("the REPL is not connected; use \\reconnect or \\connect ENDPOINT.")
        if self.multi:
            raise ProbeError("this command talks to one process; pick one with \\rank N (\\ranks all is on).")
        return self._targets[0]

    def targets(self):
        if not self._targets:
            raise ProbeError("the REPL is not connected; use \\reconnect or \\connect ENDPOINT.")
        return list(self._targets)

    @property
    def label(self) -> str:
        kind, value = self.spec
        if kind == "ranks":
            return f"ranks {value}"
        if not self._targets:
            return str(value)
        t = self._targets[0]
        if t.rank is not None:
            return f"rank {t.rank}" + (f" pid {t.pid}" if t.pid else "")
        return f"pid {t.pid}" if t.pid else t.label

    def record_note(self) -> str | None:
        """How the process ended, when this session reads one dead process's post-mortem record."""
        record = getattr(self._targets[0], "record", None) if len(self._targets) == 1 else None
        return record.describe() if record is not None else None

    # -- running the CLI's own commands -------------------------------------------------
    def run_command(self, name: str, argv: list[str]) -> int:
        """Run the registered CLI command ``name`` with ``argv`` against the current target."""
        from ..commands import COMMANDS, load_all

        load_all()
        cls = COMMANDS.get(name)
        if cls is None:
            raise ProbeError(f"`probe {name}` is not part of this installation yet, so this REPL command cannot run.")
        parser = argparse.ArgumentParser(prog=f"\\{name}", add_help=False, exit_on_error=False)
        cls.add_arguments(parser)
        try:
            ns = parser.parse_args(argv)
        except SystemExit:
            return 2  # argparse printed the usage and the problem
        except argparse.ArgumentError as exc:
            raise ProbeError(f"{exc}; see `probe {name} --help`.") from None
        args = copy.copy(self.args)
        for k, v in vars(ns).items():
            setattr(args, k, v)
        args.command = name
        return int(cls().run(self, args) or 0)


class Background:
    """Refreshes the completion schema and the toolbar status on a daemon thread."""

    def __init__(
        self, session: ReplSession, specials: dict[str, str], health_every: float = 2.0, schema_every: float = 30.0
    ):
        self.session = session
        self.specials = specials
        self.health_every = health_every
        self.schema_every = schema_every
        self.completer = SqlCompleter(Schema(), specials)
        self.health: dict = {}
        self.health_error: str | None = None
        self._functions: list[str] | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._schema_due = 0.0
        self._thread = threading.Thread(target=self._loop, name="probe-repl-refresh", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def refresh(self) -> None:
        """Refresh schema and status now (after a target switch)."""
        self._schema_due = 0.0
        self.health = {}
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._tick()
            self._wake.wait(self.health_every)
            self._wake.clear()

    def _tick(self) -> None:
        s = self.session
        try:
            target = s.targets()[0]
            client = s.client(target)
            self.health = client.get("/health", timeout=2.0)
            self.health_error = None
            if time.monotonic() >= self._schema_due:
                doc = client.get("/tables", timeout=5.0)
                if self._functions is None:
                    try:
                        self._functions = duckdb_function_names()
                    except Exception:
                        self._functions = []
                # swapped in whole: the DynamicCompleter picks it up on the next keystroke
                self.completer = SqlCompleter(Schema.from_tables_doc(doc, self._functions), self.specials)
                self._schema_due = time.monotonic() + self.schema_every
        except ProbeError as exc:
            self.health_error = exc.message
        except Exception as exc:  # the REPL must outlive anything the refresh meets
            self.health_error = f"{type(exc).__name__}: {exc}"


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
