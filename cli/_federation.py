"""A query across ranks: plan it, ask each rank for its part, join the parts in DuckDB here.

``sql.federate.plan`` splits the query into one part per table (with the filters that can
be pushed down); every rank answers its parts through the fan-out; the parts become views
with a ``rank`` column in a private DuckDB database, with the client-side ``ranks.*``
views on top, and the outer query runs there.
"""

from __future__ import annotations

from probe._errors import EndpointError, PartialError, ProbeError
from probe.util.procfs import proc_state

from ._fanout import fan_out

__all__ = ["federated_query", "fetch_schema", "open_database", "add_views", "run_outer"]


def fetch_schema(session, targets) -> dict:
    """``{table: {column: type}}`` from the first ranks that answer GET /tables."""
    last = None
    for i in range(0, len(targets), 4):
        for a in fan_out(targets[i:i + 4], lambda t: session.client(t).get("/tables")):
            if a.ok:
                return {t["name"]: {c["name"]: c["type"] for c in t["columns"]} for t in a.value["tables"]}
            last = a
    raise EndpointError(f"no rank answered to list its tables: {last.target.label}: {last.error}.")


def federated_query(session, sql: str, max_rows: int | None = None):
    """Run ``sql`` across the ranks of ``--ranks``; return the combined Result.

    When some ranks fail, the result is printed here and PartialError is raised
    (exit code 7) naming them.
    """
    from probe.sql.federate import plan, view_params

    targets = session.targets()
    schema = fetch_schema(session, targets)
    p = plan(sql, schema, view_params(strict=True))
    con, failed = open_database(session, targets, schema, p.parts)
    try:
        add_views(con, p.views)
        con.execute("SET lock_configuration = true")
        result = run_outer(con, p.outer, max_rows or 10000)
    finally:
        con.close()
    result.meta = {"ranks": [t.rank for t in targets], "parts": p.parts, "failed": sorted(r for r in failed if r is not None)}
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


def open_database(session, targets, schema: dict, parts: dict):
    """A private DuckDB database here, with one view per part (``{table: per-rank SQL}``) over
    every target's answer, a ``rank`` column added, and ``ranks.errors`` for the silent ones.

    Returns ``(connection, failed)``; ``failed`` maps a rank to ``(target, reason)``.
    """
    from probe.sql.engine import Result, connect, register_result
    from probe.sql.federate import VIEW_COLUMNS

    jobs = [(t, name, part) for t in targets for name, part in parts.items()]
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
    tables: dict = {name: ([], None) for name in parts}
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
    if truncated:
        session.note(f"probe: some per-rank answers hit the row cap and were cut: {', '.join(truncated)}.")
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
    except BaseException:
        con.close()
        raise
    return con, failed


def add_views(con, views: dict) -> None:
    """The client-side views (``ranks.stragglers`` ...) a query needs, over the parts' views."""
    for name, text in views.items():
        schema_name, short = name.split(".", 1)
        con.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema_name}"')
        con.execute(f'CREATE OR REPLACE VIEW "{schema_name}"."{short}" AS {text}')


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


def run_outer(con, sql: str, max_rows: int):
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
