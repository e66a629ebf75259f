"""``probe cancel``: drop a queued action, or interrupt a running --now eval."""

from __future__ import annotations

import json

from ..plumbing.actions import cancel
from . import Command, command


@command("cancel", "Cancel an action by id: a queued one is dropped, a running --now eval is interrupted.")
class Cancel(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("id", type=int, help="The action id (printed when it was sent; also in probe.actions).")

    def run(self, session, args):
        action = cancel(session, None, {"id": args.id})  # None: the one target of the command line
        if session.format == "json":
            session.print(json.dumps(action, indent=2, default=str))
        else:
            state = action["state"]
            session.print(
                f"action {action['id']} ({action['command']}) is {state}"
                + (": it stops at its next Python instruction." if state == "running" else ".")
            )
        return 0
