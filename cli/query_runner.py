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

import threading
from typing import Callable

from probe._errors import EndpointError, PartialError, ProbeError, QueryError
from probe.util.procfs import proc_state

from .plumbing.fanout import Answer, fan_out
from .plumbing.postmortem import is_postmortem, refine_refusal


_schemas: dict = {}  # endpoint -> ((started_at, schema_version), {table: {column: type}}), for this client's life
_schemas_lock = threading.Lock()


def _endpoint(target) -> str:
    return target.socket or f"{target.host}:{target.port}"


def _remember(target, doc: dict) -> dict:
    schema = {t["name"]: {c["name"]: c["type"] for c in t["columns"]} for t in doc["tables"]}
    identity = (doc.get("started_at"), doc.get("schema_version"))
    if None not in identity:  # an older probe does not say which process and version: ask every time
        with _schemas_lock:
            if len(_schemas) > 4096:
                _schemas.clear()
            _schemas[_endpoint(target)] = (identity, schema)
    return schema


def forget_schemas() -> None:
    """Drop every cached schema and plan (the next query of each endpoint asks for its tables again)."""
    from probe.sql.plan_cache import forget

    with _schemas_lock:
        _schemas.clear()
    forget()


def fetch_schema(session, targets) -> dict:
    """``{table: {column: type}}`` from the first ranks that answer GET /tables (one target: its own error)."""
    targets = sorted(targets, key=is_postmortem)  # a live rank's tables first: a dead rank's record keeps only some
    if len(targets) == 1:
        return _remember(targets[0], session.client(targets[0]).get("/tables"))
    last = None
    for i in range(0, len(targets), 4):
        for a in fan_out(targets[i : i + 4], lambda t: session.client(t).get("/tables")):
            if a.ok:
                return _remember(a.target, a.value)
            last = a
    raise EndpointError(f"no rank answered to list its tables: {last.target.label}: {last.error}.")


def _changed(session, targets, cached: tuple) -> bool:
    """Whether the process behind a cached schema now reports another one (asks for its tables again)."""
    fetch_schema(session, targets)
    with _schemas_lock:
        found = _schemas.get(cached[0])
    return found is None or found[0] != cached[1]


def _schema(session, targets, fresh: bool = False) -> tuple[dict, tuple | None]:
    """A schema to plan with: a cached one (and ``(endpoint, identity)`` it is valid for), else asked for (None)."""
    if not fresh:
        with _schemas_lock:
            for t in targets:
                found = _schemas.get(_endpoint(t)) if not t.entry.get("missing") else None
                if found is not None:
                    return found[1], (_endpoint(t), found[0])
    return fetch_schema(session, targets), None


def federated_query(
    session,
    sql: str,
    max_rows: int | None = None,
    targets=None,
    params: dict | None = None,
    *,
    on_workspace: Callable | None = None,
    local_tables: dict | None = None,
    partial: bool = False,
):
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
    ``partial``: a result some ranks did not answer is returned as is (``meta["failed"]`` names them), neither
    printed nor raised.
    """
    from probe.config import setting
    from probe.sql.plan_cache import PlanCache
    from probe.sql.ranks import view_params

    single = targets is not None and len(targets) == 1
    targets = targets if targets is not None else session.targets()
    values = view_params(strict=True)
    values.update({k: v for k, v in (params or {}).items() if v is not None})
    # One request per rank and query: the plan uses the schema cached from an earlier query of the same
    # process; every answer says which process and schema version it comes from, and when that is not
    # the one cached (a restart, a table registered since), the query is planned again on a fresh schema.
    schema, cached = _schema(session, targets)
    while True:
        try:
            # a client repeating a query (the web page's panels, a watch loop) parses and rewrites it once
            cache = PlanCache(schema, values, store="memory")
            p = cache.plan(sql)
            requests = cache.requests(p.parts)
            cache.save()
            # the plan is kept: the tables the client computes itself are taken out of copies
            parts = dict(p.parts)
            computed = _client_tables(session, targets, parts)
            requests = {name: r for name, r in requests.items() if name not in computed}
            ws, failed = open_database(
                session,
                targets,
                schema,
                parts,
                single=single,
                on_workspace=on_workspace,
                local_tables=local_tables,
                requests=requests,
            )
        except QueryError as exc:
            # with a cached schema, the error may come from a table registered (or gone) since: ask, and
            # plan again when the process says its schema changed; otherwise the error stands
            if cached is None or not _changed(session, targets, cached):
                raise refine_refusal(exc, targets) from None
            schema, cached = _schema(session, targets)
            continue
        if cached is None or ws.reported.get(cached[0], cached[1]) == cached[1]:
            break
        ws.close()
        schema, cached = _schema(session, targets, fresh=True)
    if targets and len(failed) == len(targets) and not computed:
        ws.close()
        raise EndpointError(
            "no rank answered the query: " + "; ".join(f"{t.label}: {e}" for t, e in failed.values()) + "."
        )
    try:
        for name, (columns, data) in computed.items():
            ws.load_tables(-1, {name: (columns, data)})
            ws.create_view(name, f'SELECT * FROM "{ws.tables[-1][name]}"')
        add_views(ws, p.views)
        result = run_outer(ws, p.outer, max_rows or setting("PROBE_MAX_ROWS"), timeout=session.timeout)
    finally:
        ws.close()
    result.meta = {
        **ws.meta,
        "ranks": [t.rank for t in targets],
        "failed": sorted(t.rank for t, _ in failed.values() if t.rank is not None),
    }
    if failed and not partial:
        from .render import render_result

        args = session.args
        session.print(
            render_result(
                result, session.format, expanded=getattr(args, "expanded", False), timing=getattr(args, "timing", False)
            )
        )
        raise PartialError(
            f"{len(failed)} of {len(targets)} ranks did not answer, the result above lacks them "
            "(SELECT * FROM ranks.errors lists them): " + "; ".join(f"{t.label}: {e}" for t, e in failed.values()) + "."
        )
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


def open_database(
    session,
    targets,
    schema: dict,
    parts: dict,
    *,
    single: bool = False,
    on_workspace: Callable | None = None,
    local_tables: dict | None = None,
    requests: dict | None = None,
    materialize: bool = False,
):
    """A private DuckDB workspace here with one view per part (``{table: per-rank SQL}``) over every
    target's snapshots, a ``rank`` column added, and ``ranks.errors`` for the silent ones.

    Each target is asked once for the columns all the parts need (``snapshot_requests``);
    its parts then run here over its own snapshots (``requests``: those columns when the caller
    already knows them). Returns ``(workspace, failed)``;
    ``failed`` maps a key to ``(target, reason)``. With ``single``, the one target's error
    is raised as is (with its own exit code) instead. ``local_tables``: see ``federated_query``. With
    ``materialize``, every part is computed once into a table (many queries over one snapshot: the doctor).
    """
    from probe.sql.engine import Result, Workspace, register_result
    from probe.sql.pushdown import slot_query, snapshot_requests

    requests = snapshot_requests(parts, schema) if requests is None else requests
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

    answers = [Answer(targets[0], ask(targets[0]))] if single else fan_out(targets, ask)
    failed = {id(a.target): (a.target, a.error) for a in answers if not a.ok}
    answered = [a for a in answers if a.ok]
    ws = Workspace(
        timeout=timeout
    )  # the timeout bounds everything DuckDB does for this query, not only its last statement
    try:
        if on_workspace is not None:
            on_workspace(ws)
        ranks = []
        for a in answered:
            meta = a.value.get("meta", {}) if requests else {}
            ranks.append(a.target.rank if a.target.rank is not None else meta.get("rank"))
        # one combined table per table and one query per part, whatever the number of ranks
        ws.load_slots([_with_local(a.value) for a in answered] if requests else [], ranks)
        for j, (name, part) in enumerate(parts.items()):
            relation = None
            if answered:
                relation = f"__p{j}"
                query, computed = slot_query(part, ws.tables.get(0, {}))
                # a part that aggregates (ranks.latest) is computed once; a plain projection stays a view
                ws.run(f'CREATE {"TABLE" if computed or materialize else "VIEW"} "{relation}" AS {query}')
            _union_view(
                ws, name, relation, schema, failed.values() if name == "ranks.latest" else (), j, register_result
            )
        errors = Result(
            ["host", "error"], ["VARCHAR", "VARCHAR"], [[t.entry.get("host"), err] for t, err in failed.values()]
        )
        register_result(ws.con, "__errors", errors, extra={"__rank": [t.rank for t, _ in failed.values()]})
        ws.create_view("ranks.errors", 'SELECT CAST("__rank" AS INTEGER) AS "rank", "host", "error" FROM "__errors"')
    except BaseException as exc:
        ws.close()
        if ws.expired and not isinstance(exc, ProbeError):  # DuckDB interrupted by the deadline: say so
            raise ws.stopped() from None
        raise
    ws.meta = (
        dict(answered[0].value.get("meta", {}), tables=list(requests)) if single and requests else {"tables": requests}
    )
    # which process and schema version each snapshot came from (federated_query checks its cached schema)
    ws.reported = {
        _endpoint(a.target): (a.value["meta"].get("started_at"), a.value["meta"].get("schema_version"))
        for a in answered
        if "schema_version" in a.value.get("meta", {})
    }
    return ws, failed


def _with_local(answer: dict) -> dict:
    """A rank's decoded snapshot with the tables read here for it (``local_tables``) added in the same form."""
    if not answer.get("local"):
        return answer
    from probe.util.wire import decode, encode

    here = decode(b"".join(bytes(b) for b in encode(answer["local"], {})))
    return {**answer, "tables": {**answer["tables"], **here["tables"]}}


def add_views(ws, views: dict) -> None:
    """The client-side views (``ranks.stragglers`` ...) a query needs, over the parts' views."""
    for name, text in views.items():
        ws.create_view(name, text)


def materialize_views(ws, views: dict) -> None:
    """As ``add_views``, but each view is computed once into a table, under the query timeout: the doctor's rules
    read the same ``ranks.*`` views over one fixed snapshot, and a view is recomputed by every query that reads it."""
    from probe.sql.columns import quote as _quote

    for name, text in views.items():
        if "." in name:
            schema, short = name.split(".", 1)
            ws.con.execute(f"CREATE SCHEMA IF NOT EXISTS {_quote(schema)}")
            target = f"{_quote(schema)}.{_quote(short)}"
        else:
            target = _quote(name)
        run_outer(ws, f"CREATE OR REPLACE TABLE {target} AS {text}", 1)


def run_outer(ws, sql: str, max_rows: int, timeout: float | None = None):
    """The outer query on the workspace: row cap, timeout (PROBE_QUERY_TIMEOUT by default), interruptible."""
    from probe.config import setting

    return ws.execute(sql, max_rows=int(max_rows), timeout=timeout or setting("PROBE_QUERY_TIMEOUT"))


def _silent_rows(columns: list, failed) -> tuple[list, list]:
    """ranks.latest keeps a row for every rank: one that did not answer is stopped or unreachable."""
    rows, ranks = [], []
    for target, error in failed:
        stopped = target.local_pid is not None and proc_state(target.local_pid) in ("T", "t")
        known = {
            "pid": target.pid,
            "host": target.entry.get("host"),
            "state": "stopped" if stopped else "unreachable",
            "top_frame": error,
        }
        rows.append([known.get(c) for c in columns])
        ranks.append(target.rank)
    return rows, ranks


def _union_view(ws, name: str, relation: str | None, schema: dict, failed, j: int, register_result) -> None:
    """View ``name``: ``relation`` (every answering rank's rows of one part, ``__rank`` first; None when no rank
    answered) with a ``rank`` column, plus a row for each silent rank where the view keeps one."""
    from probe.sql.columns import quote as q
    from probe.sql.engine import Result
    from probe.sql.federate import union_columns
    from probe.sql.rank_columns import VIEW_COLUMNS

    declared = [c for c, _, _ in VIEW_COLUMNS[name]] if name in VIEW_COLUMNS else list(schema[name])
    types = {c: t for c, t, _ in VIEW_COLUMNS[name]} if name in VIEW_COLUMNS else dict(schema[name])
    if relation is not None:
        fetched = [c for c, _ in ws.columns_of(f'"{relation}"') if c != "__rank"]
    else:
        fetched = [c for c in declared if c != "rank"]
    order = union_columns(fetched, declared)

    cols = ", ".join(f'CAST("__rank" AS INTEGER) AS {q("rank")}' if c == "rank" else q(c) for c in order)
    parts = [f"SELECT {cols} FROM {q(relation)}"] if relation is not None else []
    rows, ranks = _silent_rows([c for c in order if c != "rank"], failed)
    if rows or not parts:
        silent = Result(
            [c for c in order if c != "rank"], [types.get(c, "VARCHAR") for c in order if c != "rank"], rows
        )
        register_result(ws.con, f"__silent{j}", silent, extra={"__rank": ranks})
        parts.append(f"SELECT {cols} FROM {q(f'__silent{j}')}")
    ws.create_view(name, " UNION ALL ".join(parts))
