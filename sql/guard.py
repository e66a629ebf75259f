"""The SQL guard: accept one read-only query over registered tables, refuse the rest.

Validation is done on sqlglot's syntax tree, never with regular expressions:

* exactly one statement, and it must be a query (SELECT, WITH ... SELECT, UNION ...),
  or ``DESCRIBE t`` / ``SHOW TABLES``, which are rewritten to queries on the registry;
* no node anywhere that writes, attaches, loads, sets or copies;
* every table referenced is a registered table or a CTE of the query; table functions
  are limited to ``range``/``generate_series``/``unnest``; functions that read files or
  run SQL strings are refused by name.

DuckDB is then configured with external access disabled and its configuration
locked (see ``engine``), so the guard is one of two independent walls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError

from probe._errors import QueryError

__all__ = ["Guarded", "guard", "READ_ONLY_ROOTS", "FORBIDDEN_FUNCTIONS"]

logging.getLogger("sqlglot").setLevel(logging.ERROR)

READ_ONLY_ROOTS = (exp.Query,)

_FORBIDDEN_NODES = tuple(
    getattr(exp, name)
    for name in ("Insert", "Update", "Delete", "Merge", "Create", "Drop", "Alter", "AlterTable", "Copy",
                 "Command", "Pragma", "Set", "SetItem", "Use", "Attach", "Detach", "Install", "Load",
                 "TruncateTable", "Transaction", "Commit", "Rollback", "Export", "Into", "LoadData", "Analyze")
    if hasattr(exp, name)
)

# Table functions or scalar functions that reach files, the network, settings or run SQL strings.
FORBIDDEN_FUNCTIONS = frozenset(
    """read_csv read_csv_auto csv_scan sniff_csv read_parquet parquet_scan parquet_metadata parquet_schema
    parquet_file_metadata parquet_kv_metadata read_json read_json_auto read_json_objects read_ndjson
    read_ndjson_auto read_ndjson_objects json_scan read_text read_blob glob iceberg_scan delta_scan
    sqlite_scan sqlite_attach postgres_scan postgres_attach mysql_scan query query_table getenv
    read_xlsx st_read httpfs_scan load_extension install_extension""".split()
)

_ALLOWED_TABLE_FUNCTIONS = (exp.GenerateSeries, exp.Unnest, exp.Explode) if hasattr(exp, "Explode") else (exp.GenerateSeries, exp.Unnest)


@dataclass(frozen=True)
class Guarded:
    """A query that passed the guard: DuckDB SQL text and the registered tables it reads."""

    sql: str
    tables: tuple[str, ...]
    expression: exp.Expression


def _parse(sql: str) -> list[exp.Expression]:
    try:
        statements = [s for s in sqlglot.parse(sql, read="duckdb") if s is not None]
    except ParseError as e:
        first = e.errors[0] if e.errors else {}
        desc = str(first.get("description", e)).split(" <Token")[0]
        line, col = first.get("line"), first.get("col")
        near = first.get("highlight")
        where = f" at line {line}, column {col}" if line else ""
        near_txt = f" near '{near}'" if near else ""
        raise QueryError(f"SQL syntax error{where}{near_txt}: {desc}; fix the query and retry.", line=line, col=col) from None
    except TokenError as e:
        raise QueryError(f"SQL could not be read ({e}); check quotes and brackets.") from None
    if not statements:
        raise QueryError("the query is empty; pass a SELECT statement.")
    if len(statements) > 1:
        raise QueryError("only one statement per query is allowed; send the statements one at a time.")
    return statements


def _function_name(node: exp.Expression) -> str:
    if isinstance(node, exp.Anonymous):
        return str(node.this).lower()
    if isinstance(node, exp.Func):
        return node.sql_name().lower()
    return ""


def _rewrite_meta(stmt: exp.Expression) -> exp.Expression:
    """DESCRIBE t and SHOW TABLES become queries on the registry tables."""
    if isinstance(stmt, exp.Describe):
        target = stmt.this
        name = ".".join(p for p in (getattr(target, "db", ""), getattr(target, "name", "")) if p)
        return sqlglot.parse_one(
            "SELECT column_name, type AS column_type, description FROM probe.columns "
            f"WHERE table_name = {exp.Literal.string(name.lower()).sql()} ORDER BY position", read="duckdb")
    if isinstance(stmt, exp.Show) and str(stmt.name).upper() == "TABLES":
        return sqlglot.parse_one("SELECT name, description FROM probe.tables ORDER BY name", read="duckdb")
    return stmt


def guard(sql: str, known_tables: Iterable[str] | Callable[[], Iterable[str]]) -> Guarded:
    """Check ``sql`` and resolve its tables against ``known_tables`` (``schema.table`` names).

    >>> guard("SELECT 1 AS x", []).sql
    'SELECT 1 AS x'
    >>> guard("SELECT name FROM threads", ["python.threads"]).tables
    ('python.threads',)
    """
    stmt = _rewrite_meta(_parse(sql)[0])
    if not isinstance(stmt, READ_ONLY_ROOTS):
        kind = stmt.key.upper() if hasattr(stmt, "key") else type(stmt).__name__
        raise QueryError(f"only read queries are allowed (SELECT or WITH ... SELECT), not {kind}; probe's tables are read-only.")
    for node in stmt.walk():
        if isinstance(node, _FORBIDDEN_NODES):
            raise QueryError(f"{node.key.upper()} is not allowed inside a query; probe runs read-only SQL.")
        name = _function_name(node)
        if name in FORBIDDEN_FUNCTIONS or isinstance(node, (exp.ReadCSV,) if hasattr(exp, "ReadCSV") else ()):
            raise QueryError(f"{name or 'read_csv'}() is not allowed: queries cannot read files, settings or other SQL; query probe's tables instead.")

    known = set(known_tables() if callable(known_tables) else known_tables)
    by_short: dict[str, list[str]] = {}
    for full in known:
        by_short.setdefault(full.split(".", 1)[1], []).append(full)
    ctes = {cte.alias_or_name.lower() for cte in stmt.find_all(exp.CTE)}

    used: list[str] = []
    for tbl in list(stmt.find_all(exp.Table)):
        if not isinstance(tbl.this, exp.Identifier):
            if isinstance(tbl.this, _ALLOWED_TABLE_FUNCTIONS):
                continue
            fn = _function_name(tbl.this) or type(tbl.this).__name__.lower()
            raise QueryError(f"table function {fn}() is not allowed; query probe's tables (see `probe ENDPOINT tables`).")
        db, name = tbl.db.lower(), tbl.name.lower()
        if tbl.catalog:
            raise QueryError(f"catalog-qualified table {tbl.sql()} is not allowed; use schema.table.")
        if not db and name in ctes:
            continue
        full = f"{db}.{name}" if db else None
        if full is None and len(by_short.get(name, ())) == 1:
            full = by_short[name][0]
            tbl.set("db", exp.to_identifier(full.split(".")[0]))
        if full not in known:
            listing = ", ".join(sorted(known))
            shown = tbl.sql(dialect="duckdb")
            raise QueryError(f"unknown table {shown}; known tables: {listing}.")
        if full not in used:
            used.append(full)
    return Guarded(stmt.sql(dialect="duckdb"), tuple(used), stmt)
