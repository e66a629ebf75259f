"""``probe eval``: run Python code in the training process (the eval tier)."""

from __future__ import annotations

import sys

from probe._errors import ProbeError

from . import command
from ._action import _Action


@command(
    "eval", "Run Python code in the training process (the eval tier); prints its output, final value or traceback."
)
class Eval(_Action):
    @staticmethod
    def add_arguments(p):
        p.add_argument("code", nargs="?", help="Python code (several lines allowed); - reads standard input.")
        p.add_argument("-f", "--file", dest="file", help="Read the code from this file.")
        p.add_argument(
            "--at-step",
            action="store_true",
            dest="at_step",
            help="Run at the next step boundary, with the training loop's locals (loss, batch, ...).",
        )

    def queued(self, args) -> bool:
        return args.at_step

    def body(self, session, args, target) -> dict:
        return {"code": self._code, **({"now": False} if args.at_step else {})}

    def run(self, session, args):
        if args.code and args.file:
            raise ProbeError("give the code either as an argument or with -f FILE, not both.")
        if args.file:
            try:
                with open(args.file) as f:
                    self._code = f.read()
            except OSError as exc:
                raise ProbeError(f"cannot read {args.file} ({exc.strerror}); check the path.") from None
        elif args.code == "-":
            self._code = sys.stdin.read()
        elif args.code:
            self._code = args.code
        else:
            raise ProbeError("no code given; pass it as an argument, with -f FILE, or - for standard input.")
        return super().run(session, args)

    def describe(self, args) -> str:
        return "eval"

    def render(self, session, target, action, prefix):
        res = action.get("result") or {}
        for line in (res.get("stdout") or "").splitlines():
            session.print(prefix + line)
        for line in (res.get("stderr") or "").splitlines():
            session.note(prefix + line)
        if res.get("value") is not None:
            for line in res["value"].splitlines():
                session.print(prefix + line)
        if res.get("traceback"):
            for line in res["traceback"].rstrip().splitlines():
                session.note(prefix + line)
