"""``probe tables``: the tables of a probed process (or of several ranks) with their descriptions."""

from __future__ import annotations

import json

from . import Command, command


@command("tables", "List the tables of a probed process with their descriptions.")
class Tables(Command):
    def run(self, session, args):
        if session.multi:
            return _tables_ranks(session)
        doc = session.client().get("/tables")
        if session.format == "json":
            session.print(json.dumps(doc["tables"], indent=2))
            return 0
        from probe.sql.engine import Result

        from ..render import render_result

        rows = [[t["name"], t["kind"], len(t["columns"]), t["description"]] for t in doc["tables"]]
        session.print(
            render_result(
                Result(["name", "kind", "columns", "description"], ["VARCHAR", "VARCHAR", "INTEGER", "VARCHAR"], rows),
                session.format,
            )
        )
        return 0


def _tables_ranks(session) -> int:
    """``probe --ranks SPEC tables``: every table once, with the ranks that have it; silent ranks as rows."""
    from ..plumbing.fanout import check_partial, fan_out, format_ranks

    from probe.sql.engine import Result

    from ..render import render_result

    answers = fan_out(session.targets(), lambda t: session.client(t).get("/tables"))
    seen: dict = {}
    for a in answers:
        for t in a.value["tables"] if a.ok else ():
            seen.setdefault(t["name"], (t, []))[1].append(a.rank)
    answered = [a.rank for a in answers if a.ok]
    rows = [
        [name, t["kind"], len(t["columns"]), "all" if ranks == answered else format_ranks(ranks), t["description"]]
        for name, (t, ranks) in sorted(seen.items())
    ]
    rows += [[None, "error", None, a.target.label, a.error] for a in answers if not a.ok]
    if session.format == "json":
        session.print(
            json.dumps([dict(zip(["name", "kind", "columns", "ranks", "description"], r)) for r in rows], indent=2)
        )
    else:
        session.print(
            render_result(
                Result(
                    ["name", "kind", "columns", "ranks", "description"],
                    ["VARCHAR", "VARCHAR", "INTEGER", "VARCHAR", "VARCHAR"],
                    rows,
                ),
                session.format,
            )
        )
    check_partial(answers, "table listing")  # cli.main reports it and exits 7 (partial) or 3 (none answered)
    return 0
