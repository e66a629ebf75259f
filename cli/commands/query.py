"""The SQL commands: ``query`` (one read-only SQL query on the live tables, one rank or several, DuckDB here in
the client), ``tables`` (the tables of a probed process or of several ranks, with their descriptions),
``describe`` (one table's columns, with types and descriptions, and its examples) and ``repl`` (an interactive
SQL session). They share this module: each is a thin shell over the query path and the table listing.
"""

from __future__ import annotations

import argparse
import json
import sys

from probe._errors import ProbeError

from . import Command, command, format_flag


def _read_sql(text: str) -> str:
    if text == "-":
        return sys.stdin.read()
    return text


@command("query", "Run one read-only SQL query on the live tables.", aliases=("sql",))
class Query(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("sql", help="The SQL query, or - to read it from standard input.")
        format_flag(p)
        p.add_argument(
            "--max-rows", type=int, default=None, help="Row cap of the result (default PROBE_MAX_ROWS, 10000)."
        )
        p.add_argument("--expanded", "-x", action="store_true", help="One column per line, like psql's \\x.")
        p.add_argument(
            "--timing",
            action="store_true",
            help="Print the time DuckDB took (here, in the client) and the snapshot's time in the process.",
        )
        p.add_argument(
            "--native",
            action="store_true",
            help="python.backtrace includes native (C/C++) frames (is_native), read with py-spy on this host.",
        )

    def run(self, session, args):
        from probe.util.validate import BadRequest, count

        from ..query_runner import federated_query

        sql = _read_sql(args.sql)
        try:
            max_rows = count(args.max_rows, "--max-rows", minimum=1)
        except BadRequest as exc:
            raise ProbeError(exc.message, exit_code=2) from None
        # one rank is federation with one rank: the same snapshots, DuckDB here in the CLI
        targets = None if session.multi else [session.target()]
        local = {"python.backtrace": lambda t: _native_backtrace(session, t)} if args.native else None
        result = federated_query(session, sql, max_rows=max_rows, targets=targets, local_tables=local)
        from ..render import render_result

        session.print(render_result(result, session.format, expanded=args.expanded, timing=args.timing))
        return 0


def _native_backtrace(session, target) -> tuple:
    """python.backtrace of ``target`` with its native frames: the server's stacks merged with py-spy's."""
    from ..stacks import backtrace_doc, backtrace_table

    if target.local_pid is None:
        raise ProbeError(
            f"{target.label} is not on this host: --native reads the process with py-spy, which works only "
            "on its host; run the query on the process's node."
        )
    doc = backtrace_doc(session, target, argparse.Namespace(native=True, subprocesses=False, thread=None, locals=False))
    return backtrace_table(doc)


@command("tables", "List the tables of a probed process with their descriptions.")
class Tables(Command):
    def run(self, session, args):
        if session.multi:
            return _tables_ranks(session)
        doc = session.client().get("/tables")
        if session.format == "json":
            session.print(json.dumps(doc["tables"], indent=2))
            return 0
        from ..render import render_rows

        rows = [[t["name"], t["kind"], len(t["columns"]), t["description"]] for t in doc["tables"]]
        types = ["VARCHAR", "VARCHAR", "INTEGER", "VARCHAR"]
        session.print(render_rows(["name", "kind", "columns", "description"], types, rows, session.format))
        return 0


def _tables_ranks(session) -> int:
    """``probe --ranks SPEC tables``: every table once, with the ranks that have it; silent ranks as rows."""
    from ..plumbing.fanout import check_partial, fan_out, format_ranks
    from ..render import render_rows

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
    types = ["VARCHAR", "VARCHAR", "INTEGER", "VARCHAR", "VARCHAR"]
    session.print(render_rows(["name", "kind", "columns", "ranks", "description"], types, rows, session.format))
    check_partial(answers, "table listing")  # cli.main reports it and exits 7 (partial) or 3 (none answered)
    return 0


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
        from ..render import render_rows

        session.print(f"{t['name']}: {t['description']}")
        rows = [[c["name"], c["type"], c["description"]] for c in t["columns"]]
        session.print(render_rows(["column", "type", "description"], ["VARCHAR"] * 3, rows, session.format))
        if t.get("examples"):
            session.print("Examples:\n" + "\n".join(f"  {e}" for e in t["examples"]))
        return 0


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
