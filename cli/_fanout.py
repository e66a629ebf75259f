"""Fan-out to several ranks: concurrent requests, per-rank errors, partial results.

Every rank is asked on a thread pool with the per-rank timeout (``--timeout``). A rank
that is dead or silent becomes an error row naming it while the others still answer;
the command then exits with ``PARTIAL_EXIT`` (7) so scripts can tell a partial answer
from a complete one.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from probe._errors import EndpointError, PartialError, ProbeError

__all__ = ["Answer", "fan_out", "federated_query", "fanout_backtrace", "fanout_tables", "format_ranks", "PartialError",
           "PARTIAL_EXIT", "proc_state", "rank_error"]

PARTIAL_EXIT = PartialError.exit_code
MAX_WORKERS = 64


@dataclass
class Answer:
    """One rank's answer: ``value`` or ``error`` (a one-sentence reason)."""

    target: Any
    value: Any = None
    error: str | None = None

    @property
    def rank(self):
        return self.target.rank

    @property
    def ok(self) -> bool:
        return self.error is None


def format_ranks(ranks) -> str:
    """Compress rank numbers into ranges.

    >>> format_ranks([0, 1, 2, 3, 5, 7, 8])
    'ranks 0-3,5,7-8'
    >>> format_ranks([4])
    'rank 4'
    """
    ranks = sorted(r for r in ranks if r is not None)
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


def proc_state(pid: int | None) -> str | None:
    """The kernel's one-letter state of a local pid (R, S, D, T stopped, Z), or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def rank_error(target, exc: ProbeError) -> str:
    """Why a rank did not answer, with what is known locally (stopped, gone)."""
    pid = target.local_pid
    if pid is not None:
        state = proc_state(pid)
        if state in ("T", "t"):
            return f"process {pid} is stopped (SIGSTOP or a debugger); `kill -CONT {pid}` resumes it"
        if state is None or state == "Z":
            return f"process {pid} has exited; the rank is gone"
    return exc.message.rstrip(".")


def fan_out(items: list, fn: Callable, workers: int = MAX_WORKERS, target_of: Callable | None = None) -> list[Answer]:
    """Call ``fn(item)`` for every item concurrently; errors become Answer.error, in item order.

    ``target_of(item)`` names the Target of an item (default: the item is the Target).
    A local rank stopped by a signal fails at once instead of running into the timeout.
    """
    target_of = target_of or (lambda item: item)

    def one(item):
        target = target_of(item)
        if target.local_pid is not None and proc_state(target.local_pid) in ("T", "t"):
            return Answer(target, error=rank_error(target, ProbeError("stopped")))
        try:
            return Answer(target, fn(item))
        except ProbeError as exc:
            return Answer(target, error=rank_error(target, exc))
        except Exception as exc:  # a bug or an odd answer from one rank must not sink the others
            return Answer(target, error=f"{type(exc).__name__}: {exc}")

    if not items:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items)))) as pool:
        return list(pool.map(one, items))


def _errors_text(failed: list[Answer]) -> str:
    return "; ".join(f"{a.target.label}: {a.error}" for a in failed)


def check_partial(answers: list[Answer], what: str) -> None:
    """Raise when every rank failed (EndpointError) or some did (PartialError)."""
    failed = [a for a in answers if not a.ok]
    if not failed:
        return
    if len(failed) == len(answers):
        raise EndpointError(f"no rank answered the {what}: {_errors_text(failed)}.")
    raise PartialError(f"{len(failed)} of {len(answers)} ranks did not answer the {what}, the output above is partial: {_errors_text(failed)}.")


def _schema(session, targets) -> dict:
    """``{table: {column: type}}`` from the first ranks that answer GET /tables (one target: its own error)."""
    if len(targets) == 1:
        doc = session.client(targets[0]).get("/tables")
        return {t["name"]: {c["name"]: c["type"] for c in t["columns"]} for t in doc["tables"]}
    last = None
    for i in range(0, len(targets), 4):
        for a in fan_out(targets[i:i + 4], lambda t: session.client(t).get("/tables")):
            if a.ok:
                return {t["name"]: {c["name"]: c["type"] for c in t["columns"]} for t in a.value["tables"]}
            last = a
    raise EndpointError(f"no rank answered to list its tables: {last.target.label}: {last.error}.")


def _params() -> dict:
    from probe._config import setting

    out = {}
    for key, name in (("straggler_factor", "PROBE_STRAGGLER_FACTOR"), ("hung_after", "PROBE_HUNG_AFTER"),
                      ("desync_steps", "PROBE_DESYNC_STEPS")):
        try:
            out[key] = float(setting(name))
        except (TypeError, ValueError):
            raise ProbeError(f"{name} must be a number, not {os.environ.get(name)!r}.") from None
    return out


def federated_query(session, sql: str, max_rows: int | None = None, *, targets: list | None = None,
                    on_workspace: Callable | None = None):
    """Run ``sql`` over one rank or many; return the combined Result.

    One path for both: every rank hands over snapshots of the columns the query needs
    (``POST /snapshot``), and DuckDB runs here, over views that union the ranks with a
    ``rank`` column. With one target, its error is raised as is; with several, silent
    ranks become rows of ``ranks.errors``, the result is printed here and PartialError
    is raised (exit code 7) naming them. ``on_workspace(ws)`` receives the DuckDB
    workspace before the query runs (the REPL's Ctrl-C interrupts it).
    """
    from probe._config import setting
    from probe.sql.engine import Result, Workspace, register_result
    from probe.sql.federate import VIEW_COLUMNS, plan, rename_tables_sql, snapshot_requests

    single = targets is not None and len(targets) == 1
    targets = targets if targets is not None else session.targets()
    schema = _schema(session, targets)
    p = plan(sql, schema, _params())
    requests = snapshot_requests(p.parts, schema)
    timeout = session.timeout

    def ask(target):
        if not requests:
            return session.client(target).get("/health")
        return session.client(target).snapshot(requests, timeout)

    if single:
        answers = [Answer(targets[0], ask(targets[0]))]  # its own error, with its own exit code
    else:
        answers = fan_out(targets, ask)
    failed = {id(a.target): (a.target, a.error) for a in answers if not a.ok}
    answered = [a for a in answers if a.ok]
    if len(failed) == len(targets) and not single:
        raise EndpointError("no rank answered the query: " + "; ".join(f"{t.label}: {e}" for t, e in failed.values()) + ".")
    ws = Workspace()
    try:
        if on_workspace is not None:
            on_workspace(ws)
        slots = []  # (slot, rank)
        for i, a in enumerate(answered):
            meta = a.value.get("meta", {}) if requests else {}
            rank = a.target.rank if a.target.rank is not None else meta.get("rank")
            if requests:
                ws.load_snapshot(i, a.value)
            slots.append((i, rank))
        for j, (name, part) in enumerate(p.parts.items()):
            selects = []
            for i, rank in slots:
                ws.create_view(f"__p{j}_{i}", rename_tables_sql(part, ws.tables.get(i, {})))
                selects.append((f"__p{j}_{i}", rank))
            _union_view(ws, name, selects, schema, failed.values() if name == "ranks.latest" else (), j, register_result)
        errors = Result(["host", "error"], ["VARCHAR", "VARCHAR"], [[t.entry.get("host"), err] for t, err in failed.values()])
        register_result(ws.con, "__errors", errors, extra={"__rank": [t.rank for t, _ in failed.values()]})
        ws.create_view("ranks.errors", 'SELECT CAST("__rank" AS INTEGER) AS "rank", "host", "error" FROM "__errors"')
        for name, text in p.views.items():
            ws.create_view(name, text)
        result = ws.execute(p.outer, max_rows=max_rows or int(setting("PROBE_MAX_ROWS")), timeout=timeout)
    finally:
        ws.close()
    if single:
        meta = answered[0].value.get("meta", {}) if requests else {}
        result.meta = {**meta, "tables": list(requests)}
    else:
        result.meta = {"ranks": [t.rank for t in targets], "tables": requests,
                       "failed": sorted(t.rank for t, _ in failed.values() if t.rank is not None)}
    if failed:
        from ._render import render_result

        args = session.args
        session.print(render_result(result, session.format, expanded=getattr(args, "expanded", False),
                                    timing=getattr(args, "timing", False)))
        raise PartialError(f"{len(failed)} of {len(targets)} ranks did not answer, the result above lacks them "
                           "(SELECT * FROM ranks.errors lists them): "
                           + "; ".join(f"{t.label}: {e}" for t, e in failed.values()) + ".")
    return result


def _silent_rows(columns: list, failed) -> tuple[list, list]:
    """ranks.latest keeps a row for every rank: one that did not answer is stopped or unreachable."""
    rows, ranks = [], []
    for target, error in failed:
        stopped = target.local_pid is not None and proc_state(target.local_pid) in ("T", "t")
        known = {"pid": target.pid, "host": target.entry.get("host"), "state": "stopped" if stopped else "unreachable",
                 "top_frame": error}
        rows.append([known.get(c) for c in columns])
        ranks.append(target.rank)
    return rows, ranks


def _union_view(ws, name: str, selects: list, schema: dict, failed, j: int, register_result) -> None:
    """View ``name``: the per-rank relations ``selects`` ([(relation, rank)]) with a ``rank`` column, plus silent ranks."""
    from probe.sql.engine import Result
    from probe.sql.federate import VIEW_COLUMNS, union_columns

    declared = [c for c, _, _ in VIEW_COLUMNS[name]] if name in VIEW_COLUMNS else list(schema[name])
    types = {c: t for c, t, _ in VIEW_COLUMNS[name]} if name in VIEW_COLUMNS else dict(schema[name])
    fetched = [c for c, _ in ws.columns_of(f'"{selects[0][0]}"')] if selects else [c for c in declared if c != "rank"]
    order = union_columns(fetched, declared)

    def q(c):
        return '"' + c.replace('"', '""') + '"'

    parts = []
    for rel, rank in selects:
        rank_sql = "NULL" if rank is None else str(int(rank))
        cols = ", ".join(f"CAST({rank_sql} AS INTEGER) AS {q('rank')}" if c == "rank" else q(c) for c in order)
        parts.append(f"SELECT {cols} FROM {q(rel)}")
    rows, ranks = _silent_rows([c for c in order if c != "rank"], failed)
    if rows or not parts:
        silent = Result([c for c in order if c != "rank"], [types.get(c, "VARCHAR") for c in order if c != "rank"], rows)
        register_result(ws.con, f"__silent{j}", silent, extra={"__rank": ranks})
        cols = ", ".join(f'CAST("__rank" AS INTEGER) AS {q("rank")}' if c == "rank" else q(c) for c in order)
        parts.append(f"SELECT {cols} FROM {q(f'__silent{j}')}")
    ws.create_view(name, " UNION ALL ".join(parts))


def fanout_backtrace(session, args) -> int:
    """``probe --ranks SPEC backtrace [--group]``: per-rank sections, or identical stacks merged."""
    import json

    from .commands.core import backtrace_doc
    from ._render import render_backtrace
    from ._stacks import group_text

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


def fanout_tables(session) -> int:
    """``probe --ranks SPEC tables``: every table once, with the ranks that have it; silent ranks as rows."""
    import json

    from probe.sql.engine import Result

    from ._render import render_result

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
