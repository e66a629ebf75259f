"""``probe describe``: one table's columns, with types and descriptions, and its examples."""

from __future__ import annotations

import json

from probe._errors import ProbeError

from . import Command, command


@command("describe", "Show the columns of one table, with types and descriptions.")
class Describe(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("table", help="Table name, e.g. python.backtrace.")

    def run(self, session, args):
        doc = session.client().get("/tables")
        by_name = {t["name"]: t for t in doc["tables"]}
        t = by_name.get(args.table.lower())
        if t is None:
            raise ProbeError(f"unknown table {args.table}; known tables: {', '.join(sorted(by_name))}.")
        if session.format == "json":
            session.print(json.dumps(t, indent=2))
            return 0
        from probe.sql.engine import Result

        from ..render import render_result

        session.print(f"{t['name']}: {t['description']}")
        rows = [[c["name"], c["type"], c["description"]] for c in t["columns"]]
        session.print(render_result(Result(["column", "type", "description"], ["VARCHAR"] * 3, rows), session.format))
        if t.get("examples"):
            session.print("Examples:\n" + "\n".join(f"  {e}" for e in t["examples"]))
        return 0
