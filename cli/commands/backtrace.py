"""``probe backtrace``: every thread's stack, from the server or py-spy; with --ranks, per rank or grouped."""

from __future__ import annotations

import json

from . import Command, command


@command(
    "backtrace",
    "Stacks of every thread, innermost frame first; falls back to py-spy for a hung or unprobed local process.",
    aliases=("bt",),
)
class Backtrace(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--thread", help="Only this thread (name, ident or native id).")
        p.add_argument("--locals", action="store_true", help="Show each frame's local variables (short reprs).")
        p.add_argument(
            "--native", action="store_true", help="Include native (C/C++) frames; reads the process with py-spy."
        )
        p.add_argument(
            "--subprocesses", action="store_true", help="Include child processes (DataLoader workers); uses py-spy."
        )
        p.add_argument("--group", action="store_true", help="With --ranks: merge identical stacks across ranks.")

    def run(self, session, args):
        if session.multi:
            return _backtrace_ranks(session, args)
        target = session.target()
        from ..stacks import backtrace_doc

        doc = backtrace_doc(session, target, args)
        if session.format == "json":
            session.print(json.dumps(doc, indent=2, default=str))
        else:
            from ..render import render_backtrace

            session.print(render_backtrace(doc))
        return 0


def _backtrace_ranks(session, args) -> int:
    """``probe --ranks SPEC backtrace [--group]``: per-rank sections, or identical stacks merged."""
    from ..plumbing.fanout import check_partial, fan_out

    from ..render import render_backtrace
    from ..stacks import backtrace_doc, group_text

    targets = session.targets()
    answers = fan_out(targets, lambda t: backtrace_doc(session, t, args))
    if session.format == "json":
        session.print(
            json.dumps(
                [
                    {"rank": a.rank, "label": a.target.label, **(a.value if a.ok else {"error": a.error})}
                    for a in answers
                ],
                indent=2,
                default=str,
            )
        )
    elif getattr(args, "group", False):
        session.print(group_text(answers, thread=args.thread))
    else:
        parts = []
        for a in answers:
            host = a.target.entry.get("host")
            head = (
                f"=== {a.target.label}"
                + (f" · pid {a.target.pid}" if a.target.pid else "")
                + (f" · {host}" if host else "")
                + " ==="
            )
            parts.append(head + "\n" + (render_backtrace(a.value) if a.ok else f"unreachable: {a.error}"))
        session.print("\n\n".join(parts))
    check_partial(answers, "backtrace")  # cli.main reports it and exits 7 (partial) or 3 (none answered)
    return 0
