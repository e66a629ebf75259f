"""``probe doctor``: run the diagnosis rules and say what is wrong, most severe first."""

from __future__ import annotations

import json

from . import Command, command, format_flag

# Exit code when the doctor finds a warning or worse (0 means nothing above info).
FOUND_EXIT = 8


@command(
    "doctor",
    "Say what is wrong with the job: run the diagnosis rules over its tables, most severe finding first, with the "
    "evidence and the next command.",
)
class Doctor(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--all", action="store_true", help="Also print info findings and the rules that could not run.")
        format_flag(
            p,
            ("table", "json"),
            "Output format: the findings in sentences (table, the default) or json (same as --format).",
        )

    def run(self, session, args):
        from ..doctor import diagnose

        dx = diagnose(session)
        if session.format == "json":
            session.print(json.dumps(dx.to_dict(), indent=2, default=str))
        else:
            session.print(_text(dx, args.all))
        return FOUND_EXIT if dx.worst in ("critical", "warning") else 0


def _text(dx, show_all: bool) -> str:
    shown = [f for f in dx.findings if show_all or f.severity != "info"]
    hidden = len(dx.findings) - len(shown)
    who = f"{dx.processes} process" + ("es" if dx.processes != 1 else "")
    if dx.answering != dx.processes:
        who += f" ({dx.answering} answering)"
    lines = []
    if not shown:
        lines.append(
            f"probe doctor: nothing wrong found in {who} ({dx.rules_run} rules, {dx.elapsed:.1f} s)"
            + (f"; {hidden} info finding(s), --all shows them" if hidden else "")
            + "."
        )
    else:
        lines.append(
            f"probe doctor: {len(shown)} finding(s) in {who} ({dx.rules_run} rules, {dx.elapsed:.1f} s), most severe "
            "first:"
        )
        for f in shown:
            where = " · ".join(
                x
                for x in (
                    f"rank {f.rank}" if f.rank is not None else None,
                    f"step {f.step}" if f.step is not None else None,
                )
                if x
            )
            lines.append("")
            lines.append(f"{f.severity.upper():<8} {f.family}/{f.rule}" + (f"  ({where})" if where else ""))
            lines.append(f"  {f.message[:1].upper()}{f.message[1:]}")
            for n in f.next:
                lines.append(f"  next: {n}")
        if hidden:
            lines.append("")
            lines.append(f"({hidden} info finding(s) not shown; --all shows them.)")
    if show_all and dx.rules_skipped:
        lines.append("")
        lines.append("Rules that could not run here:")
        lines += [f"  {line}" for line in dx.skipped_lines()]
    return "\n".join(lines)
