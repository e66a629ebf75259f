"""Run a guarded query on DuckDB over snapshots of the tables it reads.

One in-memory DuckDB database serves every query of the process, set up once: one
thread, a memory limit, external access and Python replacement scans off,
extensions neither installed nor loaded automatically, and then the configuration
locked. Opening a database costs about 12 ms; opening a connection to it, 0.1 ms.

Each query gets its own connection. The snapshots of the tables it reads are
registered on that connection only (numpy columns, read without a copy) under a
fixed internal name per table; the ``schema.table`` views that cast to the declared
types are created once in the database and re-bind, in each connection, to that
connection's own registration. Concurrent queries therefore never see each other's
snapshots, and closing the connection drops them. A timer interrupts DuckDB when
the query runs past its timeout; at most ``max_rows`` rows come back. DuckDB is
imported on the first query, not before.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field

from probe._errors import QueryError

__all__ = ["Result", "execute", "connect", "cancel"]

# Connections of running queries that a client named with a ``query_id``, so that
# ``cancel`` can interrupt one from another thread (the REPL's Ctrl-C).
_running: dict[str, object] = {}
_cancelled: dict[str, bool] = {}
_running_lock = threading.Lock()

_db_lock = threading.Lock()
_db: dict = {}  # "con": the shared database's own connection, "memory_limit", "pid", "views": {table: view SQL}
_inherited: list = []  # databases a forked child inherited from its parent: never closed


def _after_fork_in_child() -> None:
    global _db_lock, _running_lock
    _db_lock, _running_lock = threading.Lock(), threading.Lock()  # a parent's query may have held them


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def cancel(query_id: str) -> bool:
    """Interrupt the running query ``query_id``; True when it was running.

    A cancel that arrives before the query reached DuckDB is remembered (a few dozen
    ids at most) and stops the query as soon as it starts.
    """
    with _running_lock:
        con = _running.get(query_id)
        _cancelled[query_id] = True
        while len(_cancelled) > 64:
            _cancelled.pop(next(iter(_cancelled)))
    if con is not None:
        con.interrupt()
    return con is not None


@dataclass
class Result:
    columns: list[str]
    types: list[str]
    rows: list[list]
    elapsed: float = 0.0
    truncated: bool = False
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Result":
        return cls(d["columns"], d["types"], d["rows"], d.get("elapsed", 0.0), d.get("truncated", False), d.get("meta", {}))


def connect(memory_limit: str = "256MB"):
    """A locked-down in-memory DuckDB connection (configuration not yet locked)."""
    import duckdb

    return duckdb.connect(":memory:", config={
        "threads": 1,
        "memory_limit": memory_limit,
        "enable_external_access": False,
        "python_enable_replacements": False,
        "autoinstall_known_extensions": False,
        "autoload_known_extensions": False,
    })


def _column_expr(name: str, typ: str) -> str:
    q = '"' + name.replace('"', '""') + '"'
    if typ == "TIMESTAMP":
        return f"make_timestamp(CAST(round({q} * 1000000) AS BIGINT)) AS {q}"
    return f"CAST({q} AS {typ}) AS {q}"


def _raw_name(full: str) -> str:
    """The per-connection registration a table's view reads (registry names are identifiers)."""
    return "__probe_raw__" + full.replace(".", "__").replace('"', "")


def _shared(memory_limit: str):
    """The process's query database, made on first use; remade for a new memory limit, and in a
    forked child (DuckDB's threads do not survive a fork)."""
    with _db_lock:
        if _db.get("memory_limit") != memory_limit or _db.get("pid") != os.getpid():
            old = _db.get("con")
            if old is not None and _db.get("pid") != os.getpid():
                # A forked parent's database: destroying it here would wait on the parent's
                # DuckDB threads, which do not exist in this process. Keep it, unused.
                _inherited.append(old)
                old = None
            con = connect(memory_limit)
            con.execute("SET lock_configuration = true")
            _db.update(con=con, memory_limit=memory_limit, views={}, pid=os.getpid())
            if old is not None:
                old.close()
        return _db["con"]


def register_tables(con, tables: dict) -> None:
    """``tables`` maps ``schema.table`` to ``(columns, data)``: columns ``[(name, type)]``, data ``{name: array}``.

    The data is registered on ``con`` only; the typed view over it is created in the
    database the first time a table is seen (again if its columns change).
    """
    import numpy as np

    for full, (columns, data) in tables.items():
        arrays = {}
        for name, typ in columns:
            values = data[name]
            if not isinstance(values, np.ndarray):
                values = np.array(values, dtype=object) if len(values) else np.array([], dtype=object)
            if values.dtype == object and typ in ("BIGINT", "INTEGER", "DOUBLE", "BOOLEAN", "TIMESTAMP"):
                values = values.astype(object)
            arrays[name] = values
        raw = _raw_name(full)
        con.register(raw, arrays)
        schema, short = full.split(".", 1)
        cols = ", ".join(_column_expr(n, t) for n, t in columns)
        view = f'CREATE OR REPLACE VIEW "{schema}"."{short}" AS SELECT {cols} FROM "{raw}"'
        views = _db.get("views")
        if views is None or views.get(full) != view:
            with _db_lock:
                con.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
                con.execute(view)
                if views is not None:
                    views[full] = view


def execute(sql: str, tables: dict, *, max_rows: int = 10000, timeout: float = 10.0,
            memory_limit: str = "256MB", query_id: str | None = None) -> Result:
    """Run ``sql`` (already guarded) over ``tables`` and return at most ``max_rows`` rows.

    With a ``query_id``, ``cancel(query_id)`` from another thread stops the query.
    """
    import duckdb

    t0 = time.perf_counter()
    con = _shared(memory_limit).cursor()
    timer = None
    interrupted = threading.Event()
    try:
        register_tables(con, tables)

        def _interrupt():
            interrupted.set()
            con.interrupt()

        timer = threading.Timer(timeout, _interrupt)
        timer.daemon = True
        timer.start()
        if query_id is not None:
            with _running_lock:
                _running[query_id] = con
                early = _cancelled.pop(query_id, False)
            if early:
                raise QueryError("the query was cancelled by the client.")
        try:
            cur = con.execute(sql)
            rows = cur.fetchmany(max_rows + 1)
        except duckdb.InterruptException:
            if query_id is not None and _cancelled.get(query_id):
                raise QueryError("the query was cancelled by the client.") from None
            raise QueryError(f"the query ran past its {timeout:g} s timeout and was stopped; narrow it or raise --timeout.") from None
        except duckdb.Error as e:
            if query_id is not None and _cancelled.get(query_id):
                raise QueryError("the query was cancelled by the client.") from None
            if interrupted.is_set():
                raise QueryError(f"the query ran past its {timeout:g} s timeout and was stopped; narrow it or raise --timeout.") from None
            msg = str(e).strip().splitlines()[0]
            raise QueryError(f"DuckDB refused the query: {msg}") from None
        desc = cur.description or []
        truncated = len(rows) > max_rows
        return Result(
            columns=[d[0] for d in desc],
            types=[str(d[1]) for d in desc],
            rows=[list(r) for r in rows[:max_rows]],
            elapsed=time.perf_counter() - t0,
            truncated=truncated,
        )
    finally:
        if timer is not None:
            timer.cancel()
        if query_id is not None:
            with _running_lock:
                _running.pop(query_id, None)
                _cancelled.pop(query_id, None)
        con.close()


def register_result(con, name: str, result: Result, extra: dict | None = None) -> None:
    """Load a Result received over the wire into ``con`` as view ``name``, with its types.

    ``extra`` adds constant-per-row columns first (e.g. ``{"rank": [0, 0, 1]}``).
    """
    import numpy as np

    arrays = {}
    for col, values in (extra or {}).items():
        arrays[col] = np.array(values, dtype=object)
    for i, col in enumerate(result.columns):
        arrays[col] = np.array([r[i] for r in result.rows], dtype=object) if result.rows else np.array([], dtype=object)
    raw = f"__raw_{abs(hash(name))}"
    con.register(raw, arrays)
    exprs = [f'"{c}"' for c in (extra or {})]
    for col, typ in zip(result.columns, result.types):
        q = '"' + col.replace('"', '""') + '"'
        simple = typ.split("(")[0] in ("BIGINT", "INTEGER", "DOUBLE", "VARCHAR", "BOOLEAN", "TIMESTAMP", "FLOAT",
                                       "SMALLINT", "TINYINT", "HUGEINT", "UBIGINT", "UINTEGER", "DATE", "DECIMAL", "TIMESTAMP WITH TIME ZONE")
        exprs.append(f"TRY_CAST({q} AS {typ}) AS {q}" if simple else f"CAST({q} AS VARCHAR) AS {q}")
    con.execute(f'CREATE OR REPLACE VIEW "{name}" AS SELECT {", ".join(exprs) or "*"} FROM {raw}')
