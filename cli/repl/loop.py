"""The interactive SQL session: ``probe ENDPOINT`` with no command.

The loop is thin: read input with prompt-toolkit, hand SQL to the executor and
backslash commands to the special-command registry, print what comes back. Errors
print inline and the loop goes on; a target that went away is reported once with how
to reconnect. Without a terminal (input piped in) the same statements run in order.

The backslash commands are a registry (``special_command``); ``\\?`` is generated from it. Each handler
is ``fn(repl, arg)`` where ``arg`` is the rest of the line. Commands that exist as CLI commands
(backtrace, tables, describe, eval, lr, checkpoint, cleanup) run the registered CLI command class against
the current target, so the REPL and the command line behave the same.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from probe._errors import EndpointError, ProbeError, QueryError, exception_text

from .session import Background, Cancelled, Executor, ReplSession, describe_error, is_complete, split_statements


class Quit(Exception):
    """Leave the REPL."""


@dataclass(frozen=True)
class Special:
    name: str
    args: str
    help: str
    fn: Callable


SPECIALS: dict[str, Special] = {}


def special_command(name: str, args: str, help: str, aliases: tuple[str, ...] = ()):
    """Register ``fn(repl, arg)`` as the backslash command ``name`` (with ``aliases``)."""

    def register(fn):
        SPECIALS[name] = Special(name, args, help, fn)
        for a in aliases:
            SPECIALS[a] = Special(a, args, f"Same as {name}.", fn)
        return fn

    return register


def help_text() -> str:
    rows = [(f"{s.name} {s.args}".strip(), s.help) for s in SPECIALS.values() if not s.help.startswith("Same as")]
    width = max(len(r[0]) for r in rows)
    lines = [
        "SQL statements end with ';' (Enter inside one starts a new line). Tab completes tables, columns, functions."
    ]
    lines += [f"  {a.ljust(width)}  {h}" for a, h in rows]
    lines.append("Ctrl-C cancels a running query (in the target too); Ctrl-D leaves.")
    return "\n".join(lines)


def dispatch(repl, line: str) -> None:
    """Run one backslash command line."""
    name, _, arg = line.strip().partition(" ")
    spec = SPECIALS.get(name)
    if spec is None:
        raise ProbeError(f"unknown command {name}; \\? lists the commands.")
    spec.fn(repl, arg.strip())


def _split(arg: str) -> list[str]:
    try:
        return shlex.split(arg)
    except ValueError as exc:
        raise ProbeError(f"could not read the arguments ({exc}); check the quotes.") from None


@special_command("\\?", "", "Show this help.", aliases=("\\h", "help"))
def _help(repl, arg):
    repl.print(help_text())


@special_command("\\q", "", "Leave the REPL (Ctrl-D does the same).", aliases=("quit", "exit"))
def _quit(repl, arg):
    raise Quit()


@special_command("\\dt", "", "List the tables of the target with their descriptions.")
def _tables(repl, arg):
    repl.session.run_command("tables", [])


@special_command("\\d", "TABLE", "Show the columns of TABLE with types and descriptions.")
def _describe(repl, arg):
    if not arg:
        raise ProbeError("\\d needs a table name, e.g. \\d python.backtrace (\\dt lists them).")
    repl.session.run_command("describe", [arg])


@special_command("\\bt", "[THREAD]", "Backtrace of every thread (or of THREAD), innermost frame first.")
def _backtrace(repl, arg):
    repl.session.run_command("backtrace", ["--thread", arg] if arg else [])


@special_command("\\x", "", "Toggle expanded output (one column per line).")
def _expanded(repl, arg):
    repl.session.expanded = not repl.session.expanded
    repl.print(f"Expanded display is {'on' if repl.session.expanded else 'off'}.")


@special_command("\\format", "table|json|csv", "Set the output format.")
def _format(repl, arg):
    if arg not in ("table", "json", "csv"):
        raise ProbeError(f"unknown format {arg!r}; use \\format table, \\format json or \\format csv.")
    repl.session.format = arg
    repl.print(f"Output format is {arg}.")


@special_command("\\timing", "", "Toggle printing the row count and time of each query.")
def _timing(repl, arg):
    repl.session.timing = not repl.session.timing
    repl.print(f"Timing is {'on' if repl.session.timing else 'off'}.")


@special_command("\\rank", "N", "Switch to rank N (from the registry); the prompt shows it.")
def _rank(repl, arg):
    try:
        rank = int(arg)
    except ValueError:
        raise ProbeError(f"\\rank takes a rank number, e.g. \\rank 3, not {arg!r}.") from None
    repl.switch(("rank", rank))


@special_command("\\ranks", "SPEC", "Query several ranks at once: all, 0-3, 0-3,7 (results get a rank column).")
def _ranks(repl, arg):
    repl.switch(("ranks", arg or "all"))


@special_command("\\connect", "ENDPOINT", "Switch to another process: a pid, host:port or socket path.")
def _connect(repl, arg):
    if not arg:
        raise ProbeError("\\connect needs an endpoint: a pid, host:port or socket path (see `probe list`).")
    repl.switch(("endpoint", arg))


@special_command("\\reconnect", "", "Connect again to the same endpoint or rank (a restarted rank is found anew).")
def _reconnect(repl, arg):
    repl.switch(repl.session.spec)


@special_command("\\eval", "CODE", "Run Python CODE in the target (eval tier; audit-logged).")
def _eval(repl, arg):
    if not arg:
        raise ProbeError("\\eval needs Python code, e.g. \\eval print(optimizer.param_groups[0]['lr']).")
    repl.session.run_command("eval", [arg])


@special_command(
    "\\lr", "OPTIONS", "Change the learning rate at the next step, e.g. \\lr --scale 0.1 (same options as `probe lr`)."
)
def _lr(repl, arg):
    repl.session.run_command("lr", _split(arg))


@special_command("\\checkpoint", "PATH", "Save weights, optimizer, scheduler, step and RNG at the next step boundary.")
def _checkpoint(repl, arg):
    repl.session.run_command("checkpoint", _split(arg))


@special_command("\\cleanup", "", "Collect garbage and empty the CUDA cache at a safe point.")
def _cleanup(repl, arg):
    repl.session.run_command("cleanup", _split(arg))


@special_command("\\watch", "N SQL", "Run SQL every N seconds until Ctrl-C.")
def _watch(repl, arg):
    every, _, sql = arg.partition(" ")
    try:
        seconds = float(every)
        if seconds <= 0:
            raise ValueError
    except ValueError:
        raise ProbeError(
            "\\watch takes a number of seconds and a query, e.g. \\watch 2 SELECT MAX(step) FROM torch.steps."
        ) from None
    sql = sql.strip().rstrip(";").strip()
    if not sql:
        raise ProbeError("\\watch needs a query after the seconds, e.g. \\watch 2 SELECT * FROM process.info.")
    try:
        while True:
            repl.print(f"-- every {seconds:g} s: {sql}  ({time.strftime('%H:%M:%S')}; Ctrl-C stops)")
            if not repl.run_sql(sql):
                return
            time.sleep(seconds)  # ok-sleep: the user asked for this interval
    except KeyboardInterrupt:
        repl.print("Stopped watching.")


def history_path() -> Path:
    """``$XDG_STATE_HOME/probe/history``, else ``~/.local/state/probe/history``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "probe" / "history"


def _is_special(text: str) -> bool:
    word = text.strip().split(" ", 1)[0] if text.strip() else ""
    return word.startswith("\\") or word.lower() in ("quit", "exit", "help")


class Repl:
    def __init__(self, session: ReplSession):
        self.session = session
        self.executor = Executor(session)
        specials = {n: s.help for n, s in SPECIALS.items() if n.startswith("\\")}
        self.background = Background(session, specials)

    # -- output --------------------------------------------------------------------
    def print(self, text: str = "") -> None:
        self.session.print(text)

    def error(self, exc: ProbeError, sql: str | None = None) -> None:
        self.session.note(describe_error(exc, sql))
        if isinstance(exc, EndpointError) or self.session.gone:
            self.session.gone = True
            self.session.note(
                f"The target ({self.session.label}) is not answering; it may have exited. "
                "\\reconnect tries again, \\connect ENDPOINT picks another process, \\q leaves."
            )

    # -- actions -------------------------------------------------------------------
    def switch(self, spec) -> None:
        try:
            self.session.connect(spec)
        except ProbeError as exc:
            if self.session.gone:
                raise
            raise ProbeError(f"{exc.message.rstrip('.')}; still connected to {self.session.label}.") from None
        self.background.refresh()
        gone = self.session.record_note()
        self.print(
            f"Connected to the post-mortem record of {self.session.label}: {gone}; the same tables, as it left them."
            if gone
            else f"Connected to {self.session.label}."
        )

    def run_sql(self, sql: str) -> bool:
        """Run one statement and print its result; False when it failed or was cancelled."""
        from ..render import render_result

        try:
            result = self.executor.query(sql)
        except Cancelled as exc:
            self.session.note(exc.message)
            return False
        except ProbeError as exc:
            self.error(exc, sql)
            return False
        except Exception as exc:  # a statement never ends the session, whatever it ran into
            self.error(QueryError(f"the statement failed ({exception_text(exc)}); the session goes on."))
            return False
        self.print(
            render_result(result, self.session.format, expanded=self.session.expanded, timing=self.session.timing)
        )
        return True

    def handle(self, text: str) -> None:
        """Run one input: a backslash command, or one or more SQL statements."""
        if _is_special(text):
            try:
                dispatch(self, text)
            except ProbeError as exc:
                self.error(exc)
            return
        for stmt in split_statements(text):
            if not self.run_sql(stmt):
                break

    # -- loops ---------------------------------------------------------------------
    def run(self) -> int:
        self.background.start()
        try:
            if not sys.stdin.isatty():
                return self._run_script(sys.stdin.read())
            return self._run_interactive()
        finally:
            self.background.stop()

    def _run_script(self, text: str) -> int:
        failed = False
        buffer = ""
        for line in text.splitlines(keepends=True):
            if not buffer.strip() and _is_special(line):
                try:
                    dispatch(self, line)
                except Quit:
                    return 1 if failed else 0
                except ProbeError as exc:
                    self.error(exc)
                    failed = True
                continue
            buffer += line
            if is_complete(buffer):
                for stmt in split_statements(buffer):
                    failed |= not self.run_sql(stmt)
                buffer = ""
        for stmt in split_statements(buffer):
            failed |= not self.run_sql(stmt)
        return 1 if failed else 0

    def _run_interactive(self) -> int:
        prompt = self._prompt_session()
        self.print(f"probe SQL on {self.session.label}. \\? for help, \\q or Ctrl-D to leave.")
        while True:
            try:
                text = prompt.prompt()
            except KeyboardInterrupt:
                continue
            except EOFError:
                break
            try:
                self.handle(text)
            except Quit:
                break
            except KeyboardInterrupt:
                self.session.note("interrupted.")
        return 0

    def _prompt_session(self):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.application.current import get_app
        from prompt_toolkit.auto_suggest import AutoSuggestFromHistory
        from prompt_toolkit.completion import DynamicCompleter
        from prompt_toolkit.filters import Condition
        from prompt_toolkit.history import FileHistory, InMemoryHistory

        path = history_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            history = FileHistory(str(path))
        except OSError:
            history = InMemoryHistory()
        lexer = None
        try:
            from prompt_toolkit.lexers import PygmentsLexer
            from pygments.lexers.sql import SqlLexer

            lexer = PygmentsLexer(SqlLexer)
        except ImportError:
            pass
        return PromptSession(
            message=lambda: f"probe {self.session.label}> ",
            prompt_continuation=lambda width, line_number, wrap_count: "...> ".rjust(width),
            multiline=Condition(lambda: not is_complete(get_app().current_buffer.text)),
            completer=DynamicCompleter(lambda: self.background.completer),
            complete_while_typing=True,
            auto_suggest=AutoSuggestFromHistory(),
            history=history,
            lexer=lexer,
            bottom_toolbar=self._toolbar,
            refresh_interval=1.0,
            enable_history_search=False,
        )

    def _toolbar(self) -> str:
        s, bg = self.session, self.background
        parts = [s.label]
        if bg.health_error:
            parts.append("not answering" if not s.gone else "gone: \\reconnect")
        elif bg.health:
            h = bg.health
            if h.get("step") is not None:
                parts.append(f"step {h['step']}")
            state = h.get("state")
            if state:
                since = h.get("hung_since")
                hung_for = (
                    f" for {time.time() - since:.0f} s" if state == "hung" and isinstance(since, (int, float)) else ""
                )
                parts.append(f"{state}{hung_for}")
        parts.append(f"format {s.format}" + (", expanded" if s.expanded else "") + (", timing" if s.timing else ""))
        return " " + " | ".join(parts) + "   \\? help  Ctrl-D quits"
