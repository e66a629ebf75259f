"""Cross-rank SQL: split one query into per-rank parts and an outer query.

``plan(sql, schema)`` reads the query once and returns a :class:`Plan`:

* ``parts``: for every federated table the query reads, the SQL each rank runs.
  For a registered table that is ``SELECT <needed columns> FROM t WHERE <filters>``:
  sqlglot's ``qualify`` resolves every column to its table, the columns the query
  touches are projected, and conjuncts of a WHERE (or an inner JOIN's ON) that read
  only that table are pushed down (ORed across several uses of the same table).
  The built-in ``ranks.latest`` is a per-rank aggregate, so its part is fixed SQL.
* ``outer``: the query itself, run by the client over views that union the parts
  with a ``rank`` column (the rank the answer came from; a table's own ``rank``
  column is never fetched, the client's is authoritative).
* ``views``: client-side views (``ranks.stragglers`` ...) the query needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sqlglot
from sqlglot import exp
from sqlglot.optimizer.qualify import qualify

from probe._config import setting
from probe._errors import QueryError

from .guard import guard

__all__ = ["Plan", "plan", "qualify_query", "table_scans", "per_rank_query",
           "FEDERATED_VIEWS", "CLIENT_VIEWS", "VIEW_COLUMNS", "view_params", "union_columns"]

RANK = "rank"

# Per-rank aggregate: one row per rank, computed on the rank's own clock (no clock skew).
FEDERATED_VIEWS = {
    "ranks.latest": """
SELECT i.pid, i.host, s.step, s.last_step_at, s.age_s, s.step_time, s.steps_seen, i.state, i.hung_since,
       (SELECT func || ' (' || regexp_replace(file, '.*/', '') || ':' || lineno || ')' FROM python.backtrace
        WHERE is_main AND depth = 0 LIMIT 1) AS top_frame,
       (SELECT count(*) > 0 FROM python.backtrace
        WHERE is_main AND file LIKE '%torch/distributed/%') AS in_collective
FROM process.info AS i,
     (SELECT max(step) AS step, max(ended_at) AS last_step_at,
             epoch(current_timestamp) - epoch(max(ended_at)) AS age_s,
             (SELECT median(duration) FROM (SELECT duration FROM torch.steps ORDER BY step DESC LIMIT 20)) AS step_time,
             count(*) AS steps_seen
      FROM torch.steps) AS s""",
}

CLIENT_VIEWS = {
    "ranks.stragglers": """
SELECT rank, step, step_time, others_step_time, step_time / others_step_time AS ratio, top_frame
FROM (SELECT a.rank, a.step, a.step_time, a.top_frame,
             (SELECT median(b.step_time) FROM ranks.latest AS b WHERE b.rank <> a.rank) AS others_step_time
      FROM ranks.latest AS a)
WHERE step_time > {straggler_factor} * others_step_time
ORDER BY ratio DESC""",
    "ranks.desync": """
SELECT rank, step, (SELECT max(step) FROM ranks.latest) - step AS behind
FROM ranks.latest
WHERE (SELECT max(step) FROM ranks.latest) - step > {desync_steps}
ORDER BY behind DESC, rank""",
    "ranks.hung": """
SELECT rank, step, age_s, state, in_collective, top_frame
FROM ranks.latest
WHERE age_s > {hung_after} OR state IN ('hung', 'stopped')
ORDER BY in_collective NULLS FIRST, rank""",
}

VIEW_COLUMNS = {
    "ranks.latest": [
        ("rank", "INTEGER", "Rank that answered."),
        ("pid", "BIGINT", "Process id of the rank."),
        ("host", "VARCHAR", "Host name of the rank."),
        ("step", "BIGINT", "Last step in torch.steps."),
        ("last_step_at", "TIMESTAMP", "When that step ended."),
        ("age_s", "DOUBLE", "Seconds since the last step ended, on the rank's own clock."),
        ("step_time", "DOUBLE", "Median duration of the last 20 steps in seconds."),
        ("steps_seen", "BIGINT", "Rows in the rank's torch.steps ring."),
        ("state", "VARCHAR", "training, idle or hung (from process.info); stopped or unreachable for a rank that did not answer."),
        ("hung_since", "TIMESTAMP", "When the hang watchdog saw the last step, if it fired."),
        ("top_frame", "VARCHAR", "Innermost frame of the main thread: func (file:line)."),
        ("in_collective", "BOOLEAN", "Whether the main thread is inside a torch.distributed call."),
    ],
    "ranks.stragglers": [
        ("rank", "INTEGER", "Rank that is slower than the others."),
        ("step", "BIGINT", "Its last step."),
        ("step_time", "DOUBLE", "Its median step time in seconds."),
        ("others_step_time", "DOUBLE", "Median step time of the other ranks."),
        ("ratio", "DOUBLE", "step_time / others_step_time; above PROBE_STRAGGLER_FACTOR."),
        ("top_frame", "VARCHAR", "Innermost frame of its main thread."),
    ],
    "ranks.desync": [
        ("rank", "INTEGER", "Rank whose step counter lags."),
        ("step", "BIGINT", "Its last step."),
        ("behind", "BIGINT", "Steps behind the most advanced rank; above PROBE_DESYNC_STEPS."),
    ],
    "ranks.hung": [
        ("rank", "INTEGER", "Rank without a step for longer than PROBE_HUNG_AFTER (or flagged by the watchdog)."),
        ("step", "BIGINT", "Its last step."),
        ("age_s", "DOUBLE", "Seconds since its last step."),
        ("state", "VARCHAR", "State from process.info, or stopped (SIGSTOP) for a rank that did not answer."),
        ("in_collective", "BOOLEAN", "True: waiting inside a collective for another rank; False: the likely culprit."),
        ("top_frame", "VARCHAR", "Innermost frame of its main thread."),
    ],
    "ranks.errors": [
        ("rank", "INTEGER", "Rank that did not answer."),
        ("host", "VARCHAR", "Its host, from the registry."),
        ("error", "VARCHAR", "Why: unreachable, timed out, or the query failed there."),
    ],
}

PARAM_SETTINGS = {"straggler_factor": "PROBE_STRAGGLER_FACTOR", "hung_after": "PROBE_HUNG_AFTER",
                  "desync_steps": "PROBE_DESYNC_STEPS"}


def view_params(environ: dict | None = None, strict: bool = False) -> dict:
    """The client views' parameters from their typed settings (``environ={}``: the defaults)."""
    return {key: setting(name, environ, strict=strict) for key, name in PARAM_SETTINGS.items()}


@dataclass
class Plan:
    """What to send to every rank and what to run on the client."""

    outer: str
    parts: dict[str, str] = field(default_factory=dict)
    views: dict[str, str] = field(default_factory=dict)


def _table_name(tbl: exp.Table) -> str:
    return f"{tbl.db}.{tbl.name}".lower() if tbl.db else tbl.name.lower()


def qualify_query(expression: exp.Expression, schema: dict) -> exp.Expression:
    """Qualify every column with its table alias and expand stars (a copy).

    ``schema`` maps ``schema.table`` to ``{column: type}``.

    >>> e = sqlglot.parse_one("SELECT step FROM torch.steps WHERE loss > 1", read="duckdb")
    >>> qualify_query(e, {"torch.steps": {"step": "BIGINT", "loss": "DOUBLE"}}).sql("duckdb")
    'SELECT steps.step AS step FROM torch.steps AS steps WHERE steps.loss > 1'
    """
    nested: dict = {}
    for full, cols in schema.items():
        db, name = full.split(".", 1)
        nested.setdefault(db, {})[name] = dict(cols)
    try:
        return qualify(expression.copy(), schema=nested, dialect="duckdb", quote_identifiers=False,
                       validate_qualify_columns=False, identify=False)
    except sqlglot.errors.OptimizeError as exc:
        raise QueryError(f"the query could not be split across ranks ({exc}); check the column names.") from None


def _pushable(cond: exp.Expression, alias: str, columns: set) -> bool:
    if cond.find(exp.Select, exp.Subquery, exp.AggFunc, exp.Window, exp.Star):
        return False
    cols = list(cond.find_all(exp.Column))
    return bool(cols) and all(c.table == alias and c.name in columns and c.name != RANK for c in cols)


def _conjuncts(cond: exp.Expression | None) -> list:
    if cond is None:
        return []
    return list(cond.flatten()) if isinstance(cond, exp.And) else [cond]


def _occurrence_filters(tbl: exp.Table, columns: set) -> list:
    """Conjuncts of the enclosing SELECT that read only ``tbl`` and may run before the join."""
    select = tbl.parent_select
    alias = tbl.alias_or_name
    if select is None:
        return []
    joins = select.args.get("joins") or []
    kinds = [(j.side or "").upper() for j in joins]
    in_from = isinstance(tbl.parent, exp.From)
    if any(k in ("RIGHT", "FULL") for k in kinds) or (not in_from and isinstance(tbl.parent, exp.Join) and tbl.parent.side):
        return []
    where = select.args.get("where")
    conds = [c for c in _conjuncts(where.this if where else None) if _pushable(c, alias, columns)]
    for j in joins:
        if not j.side and j.args.get("on") is not None:
            conds += [c for c in _conjuncts(j.args["on"]) if _pushable(c, alias, columns)]
    return conds


def table_scans(expression: exp.Expression, columns: dict) -> dict:
    """For each federated table of a qualified query: (needed columns, filter or None).

    ``columns`` maps ``schema.table`` to its column names. A table used several times
    gets the union of the columns and the OR of the filters (no filter if one use has none).

    >>> q = qualify_query(sqlglot.parse_one("SELECT a.step FROM torch.steps a WHERE a.loss > 1 AND a.rank = 0",
    ...                   read="duckdb"), {"torch.steps": {"step": "BIGINT", "loss": "DOUBLE", "rank": "INTEGER"}})
    >>> cols, cond = table_scans(q, {"torch.steps": ["step", "loss", "rank"]})["torch.steps"]
    >>> cols, cond.sql("duckdb")
    (['loss', 'step'], 'loss > 1')
    """
    out: dict = {}
    all_cols = list(expression.find_all(exp.Column))
    # qualify expanded SELECT *; a star left over belongs to COUNT(*) and needs no column
    has_star = any(isinstance(s.parent, (exp.Select, exp.Column)) for s in expression.find_all(exp.Star))
    for tbl in expression.find_all(exp.Table):
        name = _table_name(tbl)
        if name not in columns:
            continue
        known = set(columns[name])
        alias = tbl.alias_or_name
        used = {c.name for c in all_cols if c.table == alias and c.name in known} if not has_star else set(known)
        conds = _occurrence_filters(tbl, known)
        cond = None
        if conds:
            cond = exp.and_(*[c.copy() for c in conds])
            cond = cond.transform(lambda n: exp.column(n.name) if isinstance(n, exp.Column) else n)
        prev = out.get(name)
        if prev is None:
            out[name] = (used, cond, True)
        else:
            pcols, pcond, _ = prev
            merged = None if pcond is None or cond is None else exp.or_(pcond, cond)
            out[name] = (pcols | used, merged, True)
    return {k: (sorted(c - {RANK}), cond) for k, (c, cond, _) in out.items()}


def per_rank_query(table: str, columns: list, condition: exp.Expression | None) -> str:
    """The SQL one rank runs for ``table``.

    >>> per_rank_query("torch.steps", ["step", "loss"], sqlglot.parse_one("loss > 1"))
    'SELECT step, loss FROM torch.steps WHERE loss > 1'
    >>> per_rank_query("process.info", [], None)
    'SELECT 1 AS _present FROM process.info'
    """
    cols = [exp.column(c) for c in columns] or [exp.alias_(exp.Literal.number(1), "_present")]
    select = exp.select(*cols).from_(exp.to_table(table))
    if condition is not None:
        select = select.where(condition)
    return select.sql("duckdb")


def view_sql(name: str, params: dict | None = None) -> str:
    """The SQL of a client view with its parameters filled in.

    >>> "2.0 * others_step_time" in view_sql("ranks.stragglers", {"straggler_factor": 2.0})
    True
    """
    values = dict(view_params({}), **(params or {}))
    clean = {k: float(v) for k, v in values.items()}
    return CLIENT_VIEWS[name].strip().format(**clean)


def union_columns(fetched: list, declared: list) -> list:
    """Column order of a federated view: the table's own order, ``rank`` in its place (first when absent).

    >>> union_columns(["step", "loss"], ["step", "rank", "loss", "lr"])
    ['step', 'rank', 'loss']
    >>> union_columns(["pid"], ["pid", "host"])
    ['rank', 'pid']
    """
    order = [c for c in declared if c in fetched or c == RANK]
    order += [c for c in fetched if c not in order]
    return order if RANK in order else [RANK] + order


def _tables_of(sql: str, known: set) -> list:
    return list(guard(sql, known).tables)


def plan(sql: str, schema: dict, params: dict | None = None) -> Plan:
    """Split ``sql`` for federation; ``schema`` maps ``schema.table`` to ``{column: type}`` as the ranks report it.

    >>> p = plan("SELECT rank, max(step) FROM torch.steps GROUP BY rank", {"torch.steps": {"step": "BIGINT", "rank": "INTEGER"}})
    >>> p.parts
    {'torch.steps': 'SELECT step FROM torch.steps'}
    """
    known = set(schema) | set(FEDERATED_VIEWS) | set(CLIENT_VIEWS) | {"ranks.errors"}
    guarded = guard(sql, known)
    needed = list(guarded.tables)
    views: dict[str, str] = {}
    i = 0
    while i < len(needed):
        name = needed[i]
        i += 1
        if name in CLIENT_VIEWS:
            text = view_sql(name, params)
            views[name] = text
            needed += [t for t in _tables_of(text, known) if t not in needed]
    parts: dict[str, str] = {}
    for name in needed:
        if name in FEDERATED_VIEWS:
            parts[name] = " ".join(FEDERATED_VIEWS[name].split())
    base = [t for t in needed if t in schema]
    if base:
        qschema = {t: dict(schema[t], **({} if RANK in schema[t] else {RANK: "INTEGER"})) for t in base}
        for t in known - set(base):
            if t in VIEW_COLUMNS:
                qschema[t] = {c: typ for c, typ, _ in VIEW_COLUMNS[t]}
        qualified = qualify_query(guarded.expression, qschema)
        scans = table_scans(qualified, {t: list(schema[t]) for t in base})
        for t in base:
            cols, cond = scans.get(t, (sorted(set(schema[t]) - {RANK}), None))
            parts[t] = per_rank_query(t, cols, cond)
    # dependency order: a view after the views it reads
    ordered = dict(sorted(views.items(), key=lambda kv: sum(other in kv[1] for other in views)))
    return Plan(outer=guarded.sql, parts=parts, views=ordered)
