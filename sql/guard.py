"""The SQL guard: accept one read-only query over registered tables, refuse the rest.

Validation is done on sqlglot's syntax tree, never with regular expressions:

* exactly one statement, and it must be a query (SELECT, WITH ... SELECT, UNION ...),
  or ``DESCRIBE t`` / ``SHOW TABLES``, which are rewritten to queries on the registry;
* no node anywhere that writes, attaches, loads, sets or copies;
* every table referenced is a registered table or a CTE *visible in its scope* (names are
  resolved with sqlglot's scope tools, so a CTE named like a DuckDB catalog view cannot
  be used outside the subquery that defines it); table functions are limited to
  ``range``/``generate_series``/``unnest``;
* every function called is on the allow-list of ``_functions`` (pure functions only).

DuckDB is then configured with external access disabled and its configuration
locked (see ``engine``), so the guard is one of two independent walls; and DuckDB runs
in the client, never in the training process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError

from probe._errors import QueryError, exception_text

from ._functions import ALLOWED_FUNCTIONS, ALLOWED_TABLE_FUNCTIONS

__all__ = ["Guarded", "guard", "unreadable", "READ_ONLY_ROOTS", "MAX_SQL_CHARS"]

logging.getLogger("sqlglot").setLevel(logging.ERROR)

READ_ONLY_ROOTS = (exp.Query,)

_FORBIDDEN_NODES = tuple(
    getattr(exp, name)
    for name in (
        "Insert",
        "Update",
        "Delete",
        "Merge",
        "Create",
        "Drop",
        "Alter",
        "AlterTable",
        "Copy",
        "Command",
        "Pragma",
        "Set",
        "SetItem",
        "Use",
        "Attach",
        "Detach",
        "Install",
        "Load",
        "TruncateTable",
        "Transaction",
        "Commit",
        "Rollback",
        "Export",
        "Into",
        "LoadData",
        "Analyze",
    )
    if hasattr(exp, name)
)

MAX_SQL_CHARS = 100_000
_TOO_DEEP = "the query nests too deeply to read (brackets or subqueries hundreds of levels deep); simplify it."
_CALL = __import__("re").compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(")
_ALLOWED_TABLE_FUNCTIONS = (
    (exp.GenerateSeries, exp.Unnest, exp.Explode) if hasattr(exp, "Explode") else (exp.GenerateSeries, exp.Unnest)
)


@dataclass(frozen=True)
class Guarded:
    """A query that passed the guard: DuckDB SQL text and the registered tables it reads."""

    sql: str
    tables: tuple[str, ...]
    expression: exp.Expression


def _parse(sql: str) -> list[exp.Expression]:
    if len(sql) > MAX_SQL_CHARS:
        raise QueryError(f"the query is {len(sql)} characters long; the limit is {MAX_SQL_CHARS}.")
    try:
        statements = [s for s in sqlglot.parse(sql, read="duckdb") if s is not None]
    except ParseError as e:
        first = e.errors[0] if e.errors else {}
        desc = str(first.get("description", e)).split(" <Token")[0]
        line, col = first.get("line"), first.get("col")
        near = first.get("highlight")
        where = f" at line {line}, column {col}" if line else ""
        near_txt = f" near '{near}'" if near else ""
        raise QueryError(
            f"SQL syntax error{where}{near_txt}: {desc}; fix the query and retry.", line=line, col=col
        ) from None
    except TokenError as e:
        raise QueryError(f"SQL could not be read ({e}); check quotes and brackets.") from None
    if not statements:
        raise QueryError("the query is empty; pass a SELECT statement.")
    if len(statements) > 1:
        raise QueryError("only one statement per query is allowed; send the statements one at a time.")
    return statements


def unreadable(exc: BaseException, name: str | None = None) -> QueryError:
    """The refusal of a query that sqlglot failed on in a way of its own (not a syntax error it reports):
    usually a function called with arguments it cannot translate, e.g. ``date()`` or ``datetime('a')``.

    >>> unreadable(IndexError("list index out of range")).message
    'the query could not be read (IndexError: list index out of range); check the arguments of its function calls.'
    """
    if isinstance(exc, RecursionError):
        return QueryError(_TOO_DEEP)
    what = f"{name}() with these arguments" if name else "the query"
    return QueryError(f"{what} could not be read ({exception_text(exc)}); check the arguments of its function calls.")


def _sql_name(node: exp.Func) -> str:
    try:
        return node.sql_name().lower()
    except Exception:  # an abstract function class: its key is still its name
        return node.key


def _function_name(node: exp.Expression) -> str:
    """The name DuckDB would see for a function call node ("" for syntax such as CURRENT_DATE)."""
    if isinstance(node, exp.Anonymous):
        return str(node.this).lower()
    if isinstance(node, exp.Func):
        try:
            text = node.sql(dialect="duckdb")
        except Exception as exc:  # e.g. DATE() with no argument: sqlglot cannot write it back
            raise unreadable(exc, _sql_name(node)) from None
        m = _CALL.match(text)
        return m.group(1).lower() if m else ""
    return ""


def _check_functions(stmt: exp.Expression) -> None:
    for node in stmt.walk():
        if isinstance(node, _FORBIDDEN_NODES):
            raise QueryError(f"{node.key.upper()} is not allowed inside a query; probe runs read-only SQL.")
        if isinstance(node, exp.Table) and not isinstance(node.this, exp.Identifier):
            continue  # a table function: checked with the tables
        if isinstance(node, (exp.Func, exp.Anonymous)) and not isinstance(node.parent, exp.Table):
            name = _function_name(node)
            if name and name not in ALLOWED_FUNCTIONS:
                raise QueryError(
                    f"function {name}() is not allowed: queries may call only DuckDB's pure functions "
                    "(no files, settings, catalog or SQL strings); query probe's tables instead."
                )


def _check_tables(stmt: exp.Expression, known: set) -> list[str]:
    """Resolve every table by scope; return the registered tables read, in order of appearance."""
    from sqlglot.optimizer.scope import traverse_scope

    by_short: dict[str, list[str]] = {}
    for full in known:
        by_short.setdefault(full.split(".", 1)[1], []).append(full)
    try:
        scopes = traverse_scope(stmt)
    except RecursionError:
        raise QueryError(_TOO_DEEP) from None
    except Exception as exc:  # sqlglot could not resolve the names: refuse rather than guess
        raise QueryError(f"the query's table names could not be resolved ({exc}); simplify it.") from None
    cte_refs: set = set()
    in_scope: set = set()
    for scope in scopes:
        for tbl in scope.tables:
            in_scope.add(id(tbl))
            if not tbl.db and tbl.name in scope.cte_sources:
                cte_refs.add(id(tbl))
    used: list[str] = []
    for tbl in list(stmt.find_all(exp.Table)):
        if not isinstance(tbl.this, exp.Identifier):
            fn = _function_name(tbl.this) or type(tbl.this).__name__.lower()
            if isinstance(tbl.this, _ALLOWED_TABLE_FUNCTIONS) or fn in ALLOWED_TABLE_FUNCTIONS:
                continue
            raise QueryError(
                f"table function {fn}() is not allowed; query probe's tables (see `probe ENDPOINT tables`)."
            )
        if id(tbl) in cte_refs:
            continue
        db, name = tbl.db.lower(), tbl.name.lower()
        if tbl.catalog:
            raise QueryError(f"catalog-qualified table {tbl.sql()} is not allowed; use schema.table.")
        full = f"{db}.{name}" if db else None
        if full is None and len(by_short.get(name, ())) == 1:
            full = by_short[name][0]
            tbl.set("db", exp.to_identifier(full.split(".")[0]))
        if full not in known or id(tbl) not in in_scope:
            listing = ", ".join(sorted(known))
            shown = tbl.sql(dialect="duckdb")
            raise QueryError(f"unknown table {shown}; known tables: {listing}.", table=shown)
        if full not in used:
            used.append(full)
    return used


def _rewrite_meta(stmt: exp.Expression) -> exp.Expression:
    """DESCRIBE t and SHOW TABLES become queries on the registry tables."""
    if isinstance(stmt, exp.Describe):
        target = stmt.this
        name = ".".join(p for p in (getattr(target, "db", ""), getattr(target, "name", "")) if p)
        return sqlglot.parse_one(
            "SELECT column_name, type AS column_type, description FROM probe.columns "
            f"WHERE table_name = {exp.Literal.string(name.lower()).sql()} ORDER BY position",
            read="duckdb",
        )
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
    try:
        stmt = _rewrite_meta(_parse(sql)[0])
    except QueryError:
        raise
    except Exception as exc:  # sqlglot's own builders fail on some calls (var_map('a')): the query is the cause
        raise unreadable(exc) from None
    if not isinstance(stmt, READ_ONLY_ROOTS):
        kind = stmt.key.upper() if hasattr(stmt, "key") else type(stmt).__name__
        raise QueryError(
            f"only read queries are allowed (SELECT or WITH ... SELECT), not {kind}; probe's tables are read-only."
        )
    try:
        _check_functions(stmt)
        used = _check_tables(stmt, set(known_tables() if callable(known_tables) else known_tables))
        text = stmt.sql(dialect="duckdb")
    except QueryError:
        raise
    except Exception as exc:  # whatever sqlglot raises on a query it accepted reading: refused, one sentence
        raise unreadable(exc) from None
    return Guarded(text, tuple(used), stmt)
