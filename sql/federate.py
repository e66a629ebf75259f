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

The ``ranks.*`` views themselves, and their parameters, are declared in ``sql.ranks``; what
every rank snapshots for its part (columns and a cheap filter), and the rewrites that point
the parts at the fetched relations, are ``sql.pushdown``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sqlglot
from sqlglot import exp
from sqlglot.optimizer.qualify import qualify

from probe._errors import QueryError

from .guard import guard, unreadable
from .rank_columns import VIEW_COLUMNS
from .ranks import CLIENT_VIEWS, FEDERATED_VIEWS, view_sql


RANK = "rank"


@dataclass
class Plan:
    """What to send to every rank and what to run on the client."""

    outer: str
    parts: dict[str, str] = field(default_factory=dict)
    views: dict[str, str] = field(default_factory=dict)


def table_name(tbl: exp.Table) -> str:
    """``schema.table`` of a table reference, lower case."""
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
        return qualify(
            expression.copy(),
            schema=nested,
            dialect="duckdb",
            quote_identifiers=False,
            validate_qualify_columns=False,
            identify=False,
        )
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
    if any(k in ("RIGHT", "FULL") for k in kinds) or (
        not in_from and isinstance(tbl.parent, exp.Join) and tbl.parent.side
    ):
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
        name = table_name(tbl)
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
    """The known tables and views a built-in view's SQL names (our own text: a word search, no parse).

    >>> _tables_of("SELECT * FROM ranks.latest l JOIN torch.steps USING (rank)",
    ...            {"torch.steps", "ranks.latest", "torch.step"})
    ['ranks.latest', 'torch.steps']
    """
    import re

    return sorted(t for t in known if re.search(r"(?<![\w.])" + re.escape(t) + r"(?![\w.])", sql))


def plan(sql: str, schema: dict, params: dict | None = None) -> Plan:
    """Split ``sql`` for federation; ``schema`` maps ``schema.table`` to ``{column: type}`` as the ranks report it.

    Whatever fails in reading, checking or rewriting the query is a QueryError (one sentence), never
    sqlglot's own exception.

    >>> p = plan("SELECT rank, max(step) FROM torch.steps GROUP BY rank",
    ...          {"torch.steps": {"step": "BIGINT", "rank": "INTEGER"}})
    >>> p.parts
    {'torch.steps': 'SELECT step FROM torch.steps'}
    """
    try:
        return _plan(sql, schema, params)
    except QueryError:
        raise
    except Exception as exc:
        raise unreadable(exc) from None


def _plan(sql: str, schema: dict, params: dict | None) -> Plan:
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
    return Plan(outer=guarded.sql, parts=parts, views=_dependency_order(views))


def _dependency_order(views: dict) -> dict:
    """Views ordered so that each comes after the views it reads.

    >>> list(_dependency_order({"a.x": "FROM a.y", "a.y": "FROM a.z", "a.z": "FROM t"}))
    ['a.z', 'a.y', 'a.x']
    """
    deps = {name: {o for o in views if o != name and o in text} for name, text in views.items()}
    ordered: dict = {}
    while len(ordered) < len(views):
        ready = [n for n in views if n not in ordered and deps[n] <= set(ordered)]
        for n in ready or [n for n in views if n not in ordered]:  # a cycle cannot happen with built-in views
            ordered[n] = views[n]
    return ordered
