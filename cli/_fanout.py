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
           "PARTIAL_EXIT", "proc_state", "rank_error", "view_params"]

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
    """``{table: {column: type}}`` from the first ranks that answer GET /tables."""
    last = None
    for i in range(0, len(targets), 4):
        for a in fan_out(targets[i:i + 4], lambda t: session.client(t).get("/tables")):
            if a.ok:
                return {t["name"]: {c["name"]: c["type"] for c in t["columns"]} for t in a.value["tables"]}
            last = a
    raise EndpointError(f"no rank answered to list its tables: {last.target.label}: {last.error}.")


def view_params(**overrides) -> dict:
    """Parameters of the ranks.* views from the settings, with explicit values (not None) on top."""
    from probe._config import setting

    out = {}
    for key, name in (("straggler_factor", "PROBE_STRAGGLER_FACTOR"), ("hung_after", "PROBE_HUNG_AFTER"),
                      ("desync_steps", "PROBE_DESYNC_STEPS")):
        try:
            out[key] = float(setting(name))
        except (TypeError, ValueError):
            raise ProbeError(f"{name} must be a number, not {os.environ.get(name)!r}.") from None
    out.update({k: float(v) for k, v in overrides.items() if v is not None})
    return out


def federated_query(session, sql: str, max_rows: int | None = None, targets=None, params: dict | None = None):
    """Run ``sql`` across the ranks of ``--ranks`` (or ``targets``); return the combined Result.

    ``params`` are the ranks.* views' parameters (default: from the settings).
    When some ranks fail, the result is printed here and PartialError is raised
    (exit code 7) naming them.
    """
    from probe.sql.engine import Result, connect, register_result
    from probe.sql.federate import VIEW_COLUMNS, plan

    targets = targets if targets is not None else session.targets()
    schema = _schema(session, targets)
    p = plan(sql, schema, params if params is not None else view_params())
    jobs = [(t, name, part) for t in targets for name, part in p.parts.items()]
    if not jobs:  # e.g. only ranks.errors: still find out which ranks answer
        jobs = [(t, None, None) for t in targets]

    def ask(job):
        target, _, part = job
        if part is None:
            return session.client(target).get("/health")
        doc = session.client(target).post("/query", {"sql": part, "max_rows": 1_000_000, "timeout": session.timeout},
                                           timeout=session.timeout)
        return Result.from_dict(doc)

    answers = fan_out(jobs, ask, target_of=lambda job: job[0])
    failed: dict = {}
    tables: dict = {name: ([], None) for name in p.parts}
    truncated = []
    for (target, name, _), a in zip(jobs, answers):
        if not a.ok:
            failed.setdefault(target.rank, (target, a.error))
            continue
        if name is None:
            continue
        ranks, res = tables[name]
        if res is None:
            res = Result(a.value.columns, a.value.types, [])
            tables[name] = (ranks, res)
        res.rows.extend(a.value.rows)
        ranks.extend([target.rank] * len(a.value.rows))
        if a.value.truncated:
            truncated.append(f"{target.label} {name}")
    con = connect()
    try:
        for i, (name, (ranks, res)) in enumerate(tables.items()):
            if res is None:
                cols = VIEW_COLUMNS.get(name) or [(c, t, "") for c, t in schema[name].items()]
                cols = [(c, t) for c, t, _ in cols if c != "rank"]
                res = Result([c for c, _ in cols], [t for _, t in cols], [])
            if name == "ranks.latest":
                _add_silent_ranks(res, ranks, failed.values())
            declared = [c for c, _, _ in VIEW_COLUMNS[name]] if name in VIEW_COLUMNS else list(schema[name])
            _create_view(con, name, res, ranks, f"__part_{i}", register_result, declared)
        errors = Result(["host", "error"], ["VARCHAR", "VARCHAR"],
                        [[t.entry.get("host"), err] for t, err in failed.values()])
        _create_view(con, "ranks.errors", errors, [t.rank for t, _ in failed.values()], "__errors", register_result,
                     ["rank", "host", "error"])
        for name, text in p.views.items():
            schema_name, short = name.split(".", 1)
            con.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema_name}"')
            con.execute(f'CREATE VIEW "{schema_name}"."{short}" AS {text}')
        con.execute("SET lock_configuration = true")
        result = _run_outer(con, p.outer, max_rows or 10000)
    finally:
        con.close()
    result.meta = {"ranks": [t.rank for t in targets], "parts": p.parts, "failed": sorted(r for r in failed if r is not None)}
    if truncated:
        session.note(f"probe: some per-rank answers hit the row cap and were cut: {', '.join(truncated)}.")
    if failed:
        if len(failed) == len(targets):
            raise EndpointError("no rank answered the query: " + "; ".join(f"{t.label}: {e}" for t, e in failed.values()) + ".")
        from ._render import render_result

        args = session.args
        session.print(render_result(result, session.format, expanded=getattr(args, "expanded", False),
                                    timing=getattr(args, "timing", False)))
        raise PartialError(f"{len(failed)} of {len(targets)} ranks did not answer, the result above lacks them "
                           "(SELECT * FROM ranks.errors lists them): "
                           + "; ".join(f"{t.label}: {e}" for t, e in failed.values()) + ".")
    return result


def _add_silent_ranks(res, ranks: list, failed) -> None:
    """ranks.latest keeps a row for every rank: one that did not answer is stopped or unreachable."""
    for target, error in failed:
        stopped = target.local_pid is not None and proc_state(target.local_pid) in ("T", "t")
        known = {"pid": target.pid, "host": target.entry.get("host"), "state": "stopped" if stopped else "unreachable",
                 "top_frame": error}
        res.rows.append([known.get(c) for c in res.columns])
        ranks.append(target.rank)


def _create_view(con, name, res, ranks, raw, register_result, declared) -> None:
    from probe.sql.federate import union_columns

    schema_name, short = name.split(".", 1)
    register_result(con, raw, res, extra={"__rank": ranks})
    cols = ", ".join('CAST("__rank" AS INTEGER) AS "rank"' if c == "rank" else '"' + c.replace('"', '""') + '"'
                     for c in union_columns(res.columns, declared))
    con.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema_name}"')
    con.execute(f'CREATE VIEW "{schema_name}"."{short}" AS SELECT {cols} FROM "{raw}"')


def _run_outer(con, sql: str, max_rows: int):
    import time

    import duckdb

    from probe._errors import QueryError
    from probe.sql.engine import Result

    t0 = time.perf_counter()
    try:
        cur = con.execute(sql)
        rows = cur.fetchmany(max_rows + 1)
    except duckdb.Error as exc:
        raise QueryError(f"DuckDB refused the query across ranks: {str(exc).strip().splitlines()[0]}") from None
    desc = cur.description or []
    return Result([d[0] for d in desc], [str(d[1]) for d in desc], [list(r) for r in rows[:max_rows]],
                  elapsed=time.perf_counter() - t0, truncated=len(rows) > max_rows)


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
