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

The ``ranks.*`` views themselves, and their parameters, are declared in ``sql.ranks``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import sqlglot
from sqlglot import exp
from sqlglot.optimizer.qualify import qualify

from probe._errors import QueryError

from .guard import guard
from .ranks import CLIENT_VIEWS, FEDERATED_VIEWS, VIEW_COLUMNS, view_params, view_sql

__all__ = ["Plan", "plan", "qualify_query", "table_scans", "per_rank_query", "filter_tree", "rename_tables",
           "rename_tables_sql", "slot_query", "snapshot_requests", "FEDERATED_VIEWS", "CLIENT_VIEWS", "VIEW_COLUMNS", "view_params",
           "union_columns"]

RANK = "rank"

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


_COMPARISONS = {exp.EQ: "=", exp.NEQ: "!=", exp.GT: ">", exp.GTE: ">=", exp.LT: "<", exp.LTE: "<="}
_FLIPPED = {">": "<", ">=": "<=", "<": ">", "<=": ">=", "=": "=", "!=": "!="}


def _literal(node: exp.Expression):
    """The Python value of a plain literal (number, string, boolean), else a sentinel."""
    if isinstance(node, exp.Neg) and isinstance(node.this, exp.Literal) and not node.this.is_string:
        value = _literal(node.this)
        return -value if isinstance(value, (int, float)) else _NO
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    if isinstance(node, exp.Literal):
        if node.is_string:
            return node.this
        try:
            return int(node.this)
        except ValueError:
            try:
                return float(node.this)
            except ValueError:
                return _NO
    return _NO


_NO = object()


def filter_tree(cond: exp.Expression | None, types: dict) -> dict | None:
    """The part of a pushed-down condition a training process can apply cheaply (``probe.agent.snapshot``), or None.

    Only comparisons of a column with a literal survive; an AND keeps the conjuncts it can
    translate (a looser filter is still correct: the client re-runs the whole query), an OR
    needs all of its branches. TIMESTAMP columns are left to the client.

    >>> filter_tree(sqlglot.parse_one("step > 10 AND lower(module) = 'x'"), {"step": "BIGINT", "module": "VARCHAR"})
    {'op': '>', 'col': 'step', 'value': 10}
    >>> filter_tree(sqlglot.parse_one("stage IN ('forward', 'backward') OR step IS NULL"), {"stage": "VARCHAR", "step": "BIGINT"})
    {'or': [{'op': 'in', 'col': 'stage', 'value': ['forward', 'backward']}, {'op': 'null', 'col': 'step'}]}
    """
    if cond is None:
        return None
    if isinstance(cond, exp.Paren):
        return filter_tree(cond.this, types)
    if isinstance(cond, exp.And):
        kids = [k for k in (filter_tree(c, types) for c in cond.flatten()) if k is not None]
        return None if not kids else kids[0] if len(kids) == 1 else {"and": kids}
    if isinstance(cond, exp.Or):
        kids = [filter_tree(c, types) for c in cond.flatten()]
        return None if any(k is None for k in kids) else {"or": kids}

    def column(node):
        if isinstance(node, exp.Column) and node.name in types and types[node.name] != "TIMESTAMP":
            return node.name
        return None

    op = _COMPARISONS.get(type(cond))
    if op is not None:
        left, right = cond.this, cond.expression
        if column(left) and _literal(right) is not _NO:
            return {"op": op, "col": column(left), "value": _literal(right)}
        if column(right) and _literal(left) is not _NO:
            return {"op": _FLIPPED[op], "col": column(right), "value": _literal(left)}
        return None
    if isinstance(cond, exp.In) and column(cond.this) and not cond.args.get("query"):
        values = [_literal(v) for v in cond.expressions]
        if values and all(v is not _NO for v in values) and len(values) <= 1000:
            return {"op": "in", "col": column(cond.this), "value": values}
        return None
    if isinstance(cond, exp.Is) and isinstance(cond.expression, exp.Null) and column(cond.this):
        return {"op": "null", "col": column(cond.this)}
    if isinstance(cond, exp.Not) and isinstance(cond.this, exp.Is) and isinstance(cond.this.expression, exp.Null) \
            and column(cond.this.this):
        return {"op": "notnull", "col": column(cond.this.this)}
    return None


def rename_tables(expression: exp.Expression, mapping: dict) -> exp.Expression:
    """Point registered tables (``schema.table``) at other relations, keeping their aliases (a copy).

    >>> rename_tables(sqlglot.parse_one("SELECT steps.step FROM torch.steps"), {"torch.steps": "__t0"}).sql("duckdb")
    'SELECT steps.step FROM "__t0" AS steps'
    """
    def swap(node):
        if isinstance(node, exp.Table) and node.db and isinstance(node.this, exp.Identifier):
            target = mapping.get(_table_name(node))
            if target is not None:
                alias = node.alias or node.name
                new = exp.Table(this=exp.to_identifier(target, quoted=True))
                new.set("alias", node.args.get("alias") or exp.TableAlias(this=exp.to_identifier(alias)))
                return new
        return node

    return expression.copy().transform(swap)


def rename_tables_sql(sql: str, mapping: dict) -> str:
    """``rename_tables`` on SQL text (DuckDB dialect)."""
    return rename_tables(sqlglot.parse_one(sql, read="duckdb"), mapping).sql("duckdb")


def slot_query(sql: str, mapping: dict, slots: str = "__slots") -> tuple[str, bool]:
    """Per-rank SQL run for every rank at once over combined tables (``engine.concat_snapshots``).

    ``mapping`` points each registered table at a relation holding every rank's rows with a
    ``__slot`` column; ``slots`` lists the slots (``__slot``, ``__rank``). Each table becomes
    the rows of the current slot inside a LATERAL join, so aggregates, ORDER BY and LIMIT
    still apply per rank, and the answer carries the slot's ``__rank``: one query instead of
    one per rank (and one registration per table instead of one per rank and table).
    Returns the query and whether it is more than a projection of one table (then it is
    worth computing once, ahead of an outer query that may read it several times).

    >>> q, computed = slot_query("SELECT max(step) AS s FROM torch.steps", {"torch.steps": "__t0__torch__steps"})
    >>> q
    'SELECT "__s"."__rank", "__x".* FROM "__slots" AS "__s", LATERAL (SELECT MAX(step) AS s FROM (SELECT * EXCLUDE ("__slot") FROM "__t0__torch__steps" WHERE "__slot" = "__s"."__slot") AS steps) AS "__x"'
    >>> computed, slot_query("SELECT step FROM torch.steps WHERE step > 1", {"torch.steps": "t"})[1]
    (True, False)
    """
    return _slot_query(sql, tuple(sorted(mapping.items())), slots)


@functools.lru_cache(maxsize=256)  # a client repeating a query (the REPL, the web page's panels) rewrites it once
def _slot_query(sql: str, items: tuple, slots: str) -> tuple[str, bool]:
    mapping = dict(items)

    def swap(node):
        if isinstance(node, exp.Table) and node.db and isinstance(node.this, exp.Identifier):
            target = mapping.get(_table_name(node))
            if target is not None:
                inner = sqlglot.parse_one(f'SELECT * EXCLUDE ("__slot") FROM "{target}" WHERE "__slot" = "__s"."__slot"',
                                          read="duckdb")
                return exp.Subquery(this=inner, alias=node.args.get("alias") or exp.TableAlias(this=exp.to_identifier(node.name)))
        return node

    expression = sqlglot.parse_one(sql, read="duckdb")
    projection = (isinstance(expression, exp.Select)
                  and not any(expression.args.get(k) for k in ("with", "group", "having", "order", "limit", "offset",
                                                              "distinct", "joins", "qualify"))
                  and not expression.find(exp.AggFunc, exp.Window, exp.Subquery))
    part = expression.transform(swap).sql("duckdb")
    return f'SELECT "__s"."__rank", "__x".* FROM "{slots}" AS "__s", LATERAL ({part}) AS "__x"', not projection


def _cond_columns(cond: exp.Expression | None) -> set:
    return {c.name for c in cond.find_all(exp.Column)} if cond is not None else set()


def snapshot_requests(parts: dict, schema: dict) -> dict:
    """What every rank must snapshot for ``parts`` (per-rank SQL): ``{table: {"columns": [...], "filter": tree}}``.

    A table read by several parts gets the union of the columns and the OR of the filters.

    >>> snapshot_requests({"torch.steps": "SELECT step FROM torch.steps WHERE step > 3"}, {"torch.steps": {"step": "BIGINT", "loss": "DOUBLE"}})
    {'torch.steps': {'columns': ['step'], 'filter': {'op': '>', 'col': 'step', 'value': 3}}}
    """
    out: dict = {}
    for part in parts.values():
        expression = sqlglot.parse_one(part, read="duckdb")
        tables = [t for t in {_table_name(t) for t in expression.find_all(exp.Table)} if t in schema]
        if not tables:
            continue
        qualified = qualify_query(expression, {t: schema[t] for t in tables})
        for name, (cols, cond) in table_scans(qualified, {t: list(schema[t]) for t in tables}).items():
            needed = set(cols) | (_cond_columns(cond) & set(schema[name]))
            if not needed:  # count(*) and the like: the cheapest column tells the row count
                needed = {next(iter(schema[name]))}
            tree = filter_tree(cond, schema[name])
            prev = out.get(name)
            if prev is None:
                out[name] = {"columns": needed, "filter": tree}
            else:
                both = None if prev["filter"] is None or tree is None else {"or": [prev["filter"], tree]}
                out[name] = {"columns": prev["columns"] | needed, "filter": both}
    return {name: {"columns": [c for c in schema[name] if c in spec["columns"]], "filter": spec["filter"]}
            for name, spec in out.items()}


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

    >>> _tables_of("SELECT * FROM ranks.latest l JOIN torch.steps USING (rank)", {"torch.steps", "ranks.latest", "torch.step"})
    ['ranks.latest', 'torch.steps']
    """
    import re

    return sorted(t for t in known if re.search(r"(?<![\w.])" + re.escape(t) + r"(?![\w.])", sql))


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
