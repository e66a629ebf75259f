"""What every rank snapshots for its part of a query, and the rewrites that run the parts on the client.

A rank's part (``sql.federate``'s per-rank SQL) reads one or more registered tables;
``snapshot_requests`` turns it into what the training process is asked for: the columns
the part reads and the share of its WHERE the training process can apply cheaply
(``filter_tree``: comparisons of a column with a literal, applied by
``probe.agent.snapshot``). The client then runs the part itself over the fetched columns:
``rename_tables`` points it at the fetched relations, ``slot_query`` at one relation
holding every rank's rows.
"""

from __future__ import annotations

import functools

import sqlglot
from sqlglot import exp

from .federate import qualify_query, table_name, table_scans


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
    >>> filter_tree(sqlglot.parse_one("stage IN ('forward', 'backward') OR step IS NULL"),
    ...             {"stage": "VARCHAR", "step": "BIGINT"})
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
    if (
        isinstance(cond, exp.Not)
        and isinstance(cond.this, exp.Is)
        and isinstance(cond.this.expression, exp.Null)
        and column(cond.this.this)
    ):
        return {"op": "notnull", "col": column(cond.this.this)}
    return None


def rename_tables(expression: exp.Expression, mapping: dict) -> exp.Expression:
    """Point registered tables (``schema.table``) at other relations, keeping their aliases (a copy).

    >>> rename_tables(sqlglot.parse_one("SELECT steps.step FROM torch.steps"), {"torch.steps": "__t0"}).sql("duckdb")
    'SELECT steps.step FROM "__t0" AS steps'
    """

    def swap(node):
        if isinstance(node, exp.Table) and node.db and isinstance(node.this, exp.Identifier):
            target = mapping.get(table_name(node))
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
    """Per-rank SQL run for every rank at once over combined tables (``columns.concat_snapshots``).

    ``mapping`` points each registered table at a relation holding every rank's rows with a
    ``__slot`` column; ``slots`` lists the slots (``__slot``, ``__rank``). Each table becomes
    the rows of the current slot inside a LATERAL join, so aggregates, ORDER BY and LIMIT
    still apply per rank, and the answer carries the slot's ``__rank``: one query instead of
    one per rank (and one registration per table instead of one per rank and table).
    Returns the query and whether it is more than a projection of one table (then it is
    worth computing once, ahead of an outer query that may read it several times).

    >>> q, computed = slot_query("SELECT max(step) AS s FROM torch.steps", {"torch.steps": "__t0__torch__steps"})
    >>> q  # doctest: +NORMALIZE_WHITESPACE
    'SELECT "__s"."__rank", "__x".* FROM "__slots" AS "__s", LATERAL (SELECT MAX(step) AS s FROM (SELECT * EXCLUDE
    ("__slot") FROM "__t0__torch__steps" WHERE "__slot" = "__s"."__slot") AS steps) AS "__x"'
    >>> computed, slot_query("SELECT step FROM torch.steps WHERE step > 1", {"torch.steps": "t"})[1]
    (True, False)
    """
    return _slot_query(sql, tuple(sorted(mapping.items())), slots)


@functools.lru_cache(maxsize=256)  # a client repeating a query (the REPL, the web page's panels) rewrites it once
def _slot_query(sql: str, items: tuple, slots: str) -> tuple[str, bool]:
    mapping = dict(items)

    def swap(node):
        if isinstance(node, exp.Table) and node.db and isinstance(node.this, exp.Identifier):
            target = mapping.get(table_name(node))
            if target is not None:
                inner = sqlglot.parse_one(
                    f'SELECT * EXCLUDE ("__slot") FROM "{target}" WHERE "__slot" = "__s"."__slot"', read="duckdb"
                )
                return exp.Subquery(
                    this=inner, alias=node.args.get("alias") or exp.TableAlias(this=exp.to_identifier(node.name))
                )
        return node

    expression = sqlglot.parse_one(sql, read="duckdb")
    projection = (
        isinstance(expression, exp.Select)
        and not any(
            expression.args.get(k)
            for k in ("with", "group", "having", "order", "limit", "offset", "distinct", "joins", "qualify")
        )
        and not expression.find(exp.AggFunc, exp.Window, exp.Subquery)
    )
    part = expression.transform(swap).sql("duckdb")
    return f'SELECT "__s"."__rank", "__x".* FROM "{slots}" AS "__s", LATERAL ({part}) AS "__x"', not projection


def _cond_columns(cond: exp.Expression | None) -> set:
    return {c.name for c in cond.find_all(exp.Column)} if cond is not None else set()


def snapshot_requests(parts: dict, schema: dict) -> dict:
    """What every rank must snapshot for ``parts`` (per-rank SQL): ``{table: {"columns": [...], "filter": tree}}``.

    A table read by several parts gets the union of the columns and the OR of the filters.

    >>> snapshot_requests({"torch.steps": "SELECT step FROM torch.steps WHERE step > 3"},
    ...                   {"torch.steps": {"step": "BIGINT", "loss": "DOUBLE"}})
    {'torch.steps': {'columns': ['step'], 'filter': {'op': '>', 'col': 'step', 'value': 3}}}
    """
    out: dict = {}
    for part in parts.values():
        expression = sqlglot.parse_one(part, read="duckdb")
        tables = [t for t in {table_name(t) for t in expression.find_all(exp.Table)} if t in schema]
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
    return {
        name: {"columns": [c for c in schema[name] if c in spec["columns"]], "filter": spec["filter"]}
        for name, spec in out.items()
    }
