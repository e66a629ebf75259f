"""Read-tier commands: list, query, tables, describe, backtrace."""

from __future__ import annotations

import argparse
import json
import sys
import time

from probe._errors import ProbeError

from . import Command, command


def _read_sql(text: str) -> str:
    if text == "-":
        return sys.stdin.read()
    return text


@command("list", "List probed processes on this host (and in PROBE_REGISTRY) grouped by job: job, pid, rank, step, endpoint.")
class List(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
        p.add_argument("--dead", action="store_true",
                       help="List processes that died (post-mortem records): pid, rank, cause, when, last step.")

    def run(self, session, args):
        if args.dead:
            return _list_dead(session, args)
        from probe._runtime import offline_status, read_entries

        from .._client import Client
        from .._endpoint import _from_entry

        entries = read_entries(clean=True)

        def health(entry):
            try:
                # each entry with its own token: a typed one goes only where the person pointed a command
                return Client(_from_entry(entry, None), timeout=min(session.timeout, 2.0)).get("/health")
            except ProbeError as exc:
                return {"unreachable": exc.message, **offline_status(entry)}  # a hang dump explains a silent server

        from .._fanout import parallel

        states = parallel(entries, health, workers=32)
        rows = []
        for e, h in zip(entries, states):
            endpoint = e.get("socket") if not e.get("shared") else f"{e.get('host')}:{e.get('tcp_port')}"
            if e.get("tcp_port") and not e.get("shared"):
                endpoint += f" tcp:{e.get('tcp_host')}:{e['tcp_port']}"
            state = h.get("state") or ("unreachable" if "unreachable" in h else "running")
            rows.append({
                "job": e.get("job"), "pid": e["pid"], "rank": e.get("rank"), "world_size": e.get("world_size"), "host": e.get("host"),
                "step": h.get("step"), "framework_step": h.get("framework_step"),
                "framework_counter": h.get("framework_counter"), "state": state, "hung_since": h.get("hung_since"),
                "endpoint": endpoint, "command": " ".join(e.get("argv", []))[:80],
            })
        # grouped by job (processes outside a job last), ranks in order within each
        rows.sort(key=lambda r: (r["job"] is None, str(r["job"]), r["rank"] is None, r["rank"] or 0, r["pid"]))
        return _print_rows(session, args, rows, {"job": "VARCHAR", "pid": "BIGINT", "rank": "INTEGER",
                                                 "world_size": "INTEGER", "host": "VARCHAR", "step": "BIGINT",
                                                 **({"framework_step": "BIGINT"} if any(r["framework_step"] is not None for r in rows) else {}),
                                                 "state": "VARCHAR", "endpoint": "VARCHAR", "command": "VARCHAR"},
                           "No probed processes found. Start one with `import probe.auto`, PROBE=1, or `probe inject PID`.")


def _print_rows(session, args, rows: list, shown: dict, empty: str) -> int:
    """Rows (dicts) as JSON, or ``empty`` as a note, or a table of the ``shown`` columns (name -> type)."""
    if args.json or session.format == "json":
        session.print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        session.note(empty)
        return 0
    from probe.sql.engine import Result

    from .._render import render_result

    cols = list(shown)
    session.print(render_result(Result(cols, list(shown.values()), [[r[c] for c in cols] for r in rows]), session.format))
    return 0


def _list_dead(session, args) -> int:
    """``probe list --dead``: the post-mortem records of processes that are gone."""
    from probe.postmortem.reader import dead_records

    rows = [{"pid": m["pid"], "rank": m.get("rank"), "job": m.get("job"), "cause": m["cause"],
             "when": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(m["time"]))),
             "last_step": m.get("last_step"), "what": m.get("summary"), "record": m["path"]}
            for m in dead_records()]
    return _print_rows(session, args, rows, {"pid": "BIGINT", "rank": "INTEGER", "cause": "VARCHAR", "when": "VARCHAR",
                                             "last_step": "BIGINT", "what": "VARCHAR"},
                       "No post-mortem records: no probed process has died here (records live in the runtime directory).")


@command("query", "Run one read-only SQL query on the live tables.", aliases=("sql",))
class Query(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("sql", help="The SQL query, or - to read it from standard input.")
        p.add_argument("-f", dest="format", choices=("table", "json", "csv"), default=argparse.SUPPRESS,
                       help="Output format (same as --format).")
        p.add_argument("--max-rows", type=int, default=None, help="Row cap of the result (default PROBE_MAX_ROWS, 10000).")
        p.add_argument("--expanded", "-x", action="store_true", help="One column per line, like psql's \\x.")
        p.add_argument("--timing", action="store_true", help="Print the time DuckDB took (here, in the client) and the snapshot's time in the process.")
        p.add_argument("--native", action="store_true",
                       help="python.backtrace includes native (C/C++) frames (is_native), read with py-spy on this host.")

    def run(self, session, args):
        from probe.util.validate import BadRequest, count

        from .._federation import federated_query

        sql = _read_sql(args.sql)
        try:
            max_rows = count(args.max_rows, "--max-rows", minimum=1)
        except BadRequest as exc:
            raise ProbeError(exc.message, exit_code=2) from None
        # one rank is federation with one rank: the same snapshots, DuckDB here in the CLI
        targets = None if session.multi else [session.target()]
        local = {"python.backtrace": lambda t: _native_backtrace(session, t)} if args.native else None
        result = federated_query(session, sql, max_rows=max_rows, targets=targets, local_tables=local)
        from .._render import render_result

        session.print(render_result(result, session.format, expanded=args.expanded, timing=args.timing))
        return 0


def _native_backtrace(session, target) -> tuple:
    """python.backtrace of ``target`` with its native frames: the server's stacks merged with py-spy's."""
    from .._stacks import backtrace_doc, backtrace_table

    if target.local_pid is None:
        raise ProbeError(f"{target.label} is not on this host: --native reads the process with py-spy, which works only "
                         "on its host; run the query on the process's node.")
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
        from probe.sql.engine import Result

        from .._render import render_result

        rows = [[t["name"], t["kind"], len(t["columns"]), t["description"]] for t in doc["tables"]]
        session.print(render_result(Result(["name", "kind", "columns", "description"],
                                           ["VARCHAR", "VARCHAR", "INTEGER", "VARCHAR"], rows), session.format))
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
        from probe.sql.engine import Result

        from .._render import render_result

        session.print(f"{t['name']}: {t['description']}")
        rows = [[c["name"], c["type"], c["description"]] for c in t["columns"]]
        session.print(render_result(Result(["column", "type", "description"], ["VARCHAR"] * 3, rows), session.format))
        if t.get("examples"):
            session.print("Examples:\n" + "\n".join(f"  {e}" for e in t["examples"]))
        return 0


@command("backtrace", "Stacks of every thread, innermost frame first; falls back to py-spy for a hung or unprobed local process.", aliases=("bt",))
class Backtrace(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--thread", help="Only this thread (name, ident or native id).")
        p.add_argument("--locals", action="store_true", help="Show each frame's local variables (short reprs).")
        p.add_argument("--native", action="store_true", help="Include native (C/C++) frames; reads the process with py-spy.")
        p.add_argument("--subprocesses", action="store_true", help="Include child processes (DataLoader workers); uses py-spy.")
        p.add_argument("--group", action="store_true", help="With --ranks: merge identical stacks across ranks.")

    def run(self, session, args):
        if session.multi:
            return _backtrace_ranks(session, args)
        target = session.target()
        from .._stacks import backtrace_doc

        doc = backtrace_doc(session, target, args)
        if session.format == "json":
            session.print(json.dumps(doc, indent=2, default=str))
        else:
            from .._render import render_backtrace

            session.print(render_backtrace(doc))
        return 0


def _backtrace_ranks(session, args) -> int:
    """``probe --ranks SPEC backtrace [--group]``: per-rank sections, or identical stacks merged."""
    from .._fanout import check_partial, fan_out

    from .._render import render_backtrace
    from .._stacks import backtrace_doc, group_text

    targets = session.targets()
    answers = fan_out(targets, lambda t: backtrace_doc(session, t, args))
    if session.format == "json":
        session.print(json.dumps([{"rank": a.rank, "label": a.target.label, **(a.value if a.ok else {"error": a.error})}
                                  for a in answers], indent=2, default=str))
    elif getattr(args, "group", False):
        session.print(group_text(answers, thread=args.thread))
    else:
        parts = []
        for a in answers:
            host = a.target.entry.get("host")
            head = f"=== {a.target.label}" + (f" · pid {a.target.pid}" if a.target.pid else "") + (f" · {host}" if host else "") + " ==="
            parts.append(head + "\n" + (render_backtrace(a.value) if a.ok else f"unreachable: {a.error}"))
        session.print("\n\n".join(parts))
    check_partial(answers, "backtrace")  # cli.main reports it and exits 7 (partial) or 3 (none answered)
    return 0


def _tables_ranks(session) -> int:
    """``probe --ranks SPEC tables``: every table once, with the ranks that have it; silent ranks as rows."""
    from .._fanout import check_partial, fan_out, format_ranks

    from probe.sql.engine import Result

    from .._render import render_result

    answers = fan_out(session.targets(), lambda t: session.client(t).get("/tables"))
    seen: dict = {}
    for a in answers:
        for t in a.value["tables"] if a.ok else ():
            seen.setdefault(t["name"], (t, []))[1].append(a.rank)
    answered = [a.rank for a in answers if a.ok]
    rows = [[name, t["kind"], len(t["columns"]), "all" if ranks == answered else format_ranks(ranks), t["description"]]
            for name, (t, ranks) in sorted(seen.items())]
    rows += [[None, "error", None, a.target.label, a.error] for a in answers if not a.ok]
    if session.format == "json":
        session.print(json.dumps([dict(zip(["name", "kind", "columns", "ranks", "description"], r)) for r in rows], indent=2))
    else:
        session.print(render_result(Result(["name", "kind", "columns", "ranks", "description"],
                                           ["VARCHAR", "VARCHAR", "INTEGER", "VARCHAR", "VARCHAR"], rows), session.format))
    check_partial(answers, "table listing")  # cli.main reports it and exits 7 (partial) or 3 (none answered)
    return 0
