"""The interactive SQL session: ``probe ENDPOINT`` with no command.

The loop is thin: read input with prompt-toolkit, hand SQL to the executor and
backslash commands to the special-command registry, print what comes back. Errors
print inline and the loop goes on; a target that went away is reported once with how
to reconnect. Without a terminal (input piped in) the same statements run in order.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from probe._errors import EndpointError, ProbeError, QueryError, exception_text

from .executor import Cancelled, Executor, describe_error, is_complete, split_statements
from .special import SPECIALS, Quit, dispatch
from .session import Background, ReplSession

__all__ = ["Repl", "history_path"]


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
