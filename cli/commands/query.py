"""``probe query``: one read-only SQL query on the live tables (one rank or several), DuckDB here in the client."""

from __future__ import annotations

import argparse
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
