"""``probe trace``: a timeline of the last steps as Chrome trace-event JSON (Perfetto, chrome://tracing)."""

from __future__ import annotations

from probe._errors import ProbeError

from . import Command, command
from probe.util.printable import printable


@command(
    "trace",
    "Write a timeline of the last steps (steps, sampled module calls, user spans, collectives) as Chrome trace-event "
    "JSON for Perfetto or chrome://tracing.",
)
class Trace(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--steps", type=int, default=10, help="How many of the latest steps to include (default 10).")
        p.add_argument(
            "-o", "--output", required=True, help="File to write the trace to; - writes it to standard output."
        )

    def run(self, session, args):
        import json
        import os
        import time

        from probe.util.files import check_target, write_file

        from ..plumbing.fanout import check_partial, fan_out
        from ..timeline import build_trace, rank_rows

        if args.steps < 1:
            raise ProbeError("--steps must be at least 1.")
        if args.output != "-":
            check_target(os.path.expanduser(args.output), replace=True)  # before the queries, not after
        started = time.perf_counter()
        answers = fan_out(session.targets(), lambda t: rank_rows(session, t, args.steps))
        ok = [a.value for a in answers if a.ok]
        if not ok:
            check_partial(answers, "timeline queries")
        doc = build_trace([rr for rr, _ in ok], {"steps": args.steps})
        text = json.dumps(doc, separators=(",", ":"), default=str)
        if args.output == "-":
            session.print(text)
        else:
            path = os.path.abspath(os.path.expanduser(args.output))
            write_file(path, lambda f: f.write(text.encode()), fix="choose another -o path")
            n = sum(1 for e in doc["traceEvents"] if e["ph"] != "M")
            summary = {
                "path": path,
                "ranks": len(ok),
                "events": n,
                "bytes": len(text),
                "seconds": round(time.perf_counter() - started, 3),
            }
            if session.format == "json":
                session.print(json.dumps(summary))
            else:
                session.print(
                    f"wrote {printable(path)}: {n} events from {len(ok)} process{'es' if len(ok) != 1 else ''} "
                    f"in {summary['seconds']:.2f} s; open it at https://ui.perfetto.dev or chrome://tracing."
                )
        for _, notes in ok:
            for note in notes:
                session.note(f"probe: {note}.")
        check_partial(answers, "timeline queries")
        return 0
