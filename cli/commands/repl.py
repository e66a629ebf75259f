"""The ``repl`` command: an interactive SQL session on one process or several ranks."""

from __future__ import annotations

from . import Command, command


@command(
    "repl",
    "Interactive SQL session with live-schema completion and backslash commands (\\? lists them); `probe ENDPOINT` "
    "alone opens it.",
)
class Repl(Command):
    def run(self, session, args):
        from ..repl.loop import Repl as ReplLoop
        from ..repl.session import ReplSession

        repl_session = ReplSession(args)
        repl_session.connect()
        return ReplLoop(repl_session).run()
