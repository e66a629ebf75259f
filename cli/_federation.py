"""A query over one rank or many: plan it, take each rank's snapshots, run DuckDB here.

``sql.federate.plan`` splits the query into one part per table (with the filters that can
be pushed down) and ``snapshot_requests`` turns the parts into what each rank must
snapshot: only those columns, cheap filters applied by the rank itself. Every rank hands
its snapshots over through the fan-out (``POST /snapshot``, numpy buffers); each rank's
parts run over its own snapshots in a private DuckDB database here, are unioned into views
with a ``rank`` column, the client-side ``ranks.*`` views go on top, and the outer query
runs there. No rank ever runs SQL; a single rank is this same path with one rank.
"""

from __future__ import annotations

from typing import Callable

from probe._errors import EndpointError, PartialError, QueryError
from probe.util.procfs import proc_state

from ._fanout import Answer, fan_out
from ._postmortem import is_postmortem, refine_refusal

__all__ = ["federated_query", "fetch_schema", "open_database", "add_views", "run_outer"]


def fetch_schema(session, targets) -> dict:
    """``{table: {column: type}}`` from the first ranks that answer GET /tables (one target: its own error)."""
    targets = sorted(targets, key=is_postmortem)  # a live rank's tables first: a dead rank's record keeps only some
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


def federated_query(session, sql: str, max_rows: int | None = None, targets=None, params: dict | None = None, *,
                    on_workspace: Callable | None = None, local_tables: dict | None = None):
    """Run ``sql`` over one rank or many (``--ranks``, or ``targets``); return the combined Result.

    One path for both: every rank hands over snapshots of the columns the query needs
    (``POST /snapshot``), and DuckDB runs here, over views that union the ranks with a
    ``rank`` column. With one target (``targets=[t]``), its error is raised as is; with
    several, silent ranks become rows of ``ranks.errors``, the result is printed here and
    PartialError is raised (exit code 7) naming them. ``params`` override the ranks.*
    views' parameters (default: their settings). ``on_workspace(ws)`` receives the DuckDB
    workspace before the query runs (the REPL's Ctrl-C interrupts it). ``local_tables`` maps
    a table name to ``read(target) -> ([(column, type)], {column: values})``: that table is
    read here for each rank (``query --native``'s python.backtrace) instead of being asked for.
    """
    from probe._config import setting
    from probe.sql.federate import plan, view_params

    single = targets is not None and len(targets) == 1
    targets = targets if targets is not None else session.targets()
    schema = fetch_schema(session, targets)
    values = view_params(strict=True)
    values.update({k: v for k, v in (params or {}).items() if v is not None})
    try:
        p = plan(sql, schema, values)
    except QueryError as exc:
        raise refine_refusal(exc, targets) from None
    computed = _client_tables(session, targets, p.parts)
    ws, failed = open_database(session, targets, schema, p.parts, single=single, on_workspace=on_workspace,
                               local_tables=local_tables)
    if targets and len(failed) == len(targets) and not computed:
        ws.close()
        raise EndpointError("no rank answered the query: " + "; ".join(f"{t.label}: {e}" for t, e in failed.values()) + ".")
    try:
        for name, (columns, data) in computed.items():
            ws.load_tables(-1, {name: (columns, data)})
            ws.create_view(name, f'SELECT * FROM "{ws.tables[-1][name]}"')
        add_views(ws, p.views)
        result = run_outer(ws, p.outer, max_rows or setting("PROBE_MAX_ROWS"), timeout=session.timeout)
    finally:
        ws.close()
    result.meta = {**ws.meta, "ranks": [t.rank for t in targets],
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


def _client_tables(session, targets, parts: dict) -> dict:
    """The tables the query reads that the client computes itself (``diagnosis.findings``: the doctor's
    findings for the same targets, see ``Session.computed_table``), taken out of ``parts`` so that no
    rank is asked for them."""
    compute = getattr(session, "computed_table", None)
    out = {}
    for name in list(parts) if compute is not None else ():
        table = compute(name, targets)
        if table is not None:
            del parts[name]
            out[name] = table
    return out


def open_database(session, targets, schema: dict, parts: dict, *, single: bool = False,
                  on_workspace: Callable | None = None, local_tables: dict | None = None):
    """A private DuckDB workspace here with one view per part (``{table: per-rank SQL}``) over every
    target's snapshots, a ``rank`` column added, and ``ranks.errors`` for the silent ones.

    Each target is asked once for the columns all the parts need (``snapshot_requests``);
    its parts then run here over its own snapshots. Returns ``(workspace, failed)``;
    ``failed`` maps a key to ``(target, reason)``. With ``single``, the one target's error
    is raised as is (with its own exit code) instead. ``local_tables``: see ``federated_query``.
    """
    from probe.sql.engine import Result, Workspace, register_result
    from probe.sql.federate import rename_tables_sql, snapshot_requests

    requests = snapshot_requests(parts, schema)
    local = {name: read for name, read in (local_tables or {}).items() if name in requests}
    remote = {name: r for name, r in requests.items() if name not in local}
    timeout = session.timeout

    def ask(target):
        if not remote:  # e.g. only ranks.errors: still find out which ranks answer
            answer = {"tables": {}, "meta": {}, "health": session.client(target).get("/health")}
        else:
            answer = session.client(target).snapshot(remote, timeout)
        answer["local"] = {name: read(target) for name, read in local.items()}
        return answer

    if single:
        answers = [Answer(targets[0], ask(targets[0]))]
    else:
        answers = fan_out(targets, ask)
    failed = {id(a.target): (a.target, a.error) for a in answers if not a.ok}
    answered = [a for a in answers if a.ok]
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
                ws.load_tables(i, a.value["local"])
            slots.append((i, rank))
        for j, (name, part) in enumerate(parts.items()):
            selects = []
            for i, rank in slots:
                ws.create_view(f"__p{j}_{i}", rename_tables_sql(part, ws.tables.get(i, {})))
                selects.append((f"__p{j}_{i}", rank))
            _union_view(ws, name, selects, schema, failed.values() if name == "ranks.latest" else (), j, register_result)
        errors = Result(["host", "error"], ["VARCHAR", "VARCHAR"], [[t.entry.get("host"), err] for t, err in failed.values()])
        register_result(ws.con, "__errors", errors, extra={"__rank": [t.rank for t, _ in failed.values()]})
        ws.create_view("ranks.errors", 'SELECT CAST("__rank" AS INTEGER) AS "rank", "host", "error" FROM "__errors"')
    except BaseException:
        ws.close()
        raise
    ws.meta = dict(answered[0].value.get("meta", {}), tables=list(requests)) if single and requests else {"tables": requests}
    return ws, failed


def add_views(ws, views: dict) -> None:
    """The client-side views (``ranks.stragglers`` ...) a query needs, over the parts' views."""
    for name, text in views.items():
        ws.create_view(name, text)


def run_outer(ws, sql: str, max_rows: int, timeout: float | None = None):
    """The outer query on the workspace: row cap, timeout (PROBE_QUERY_TIMEOUT by default), interruptible."""
    from probe._config import setting

    return ws.execute(sql, max_rows=int(max_rows), timeout=timeout or setting("PROBE_QUERY_TIMEOUT"))


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
