"""The client's query engine: DuckDB over snapshots that training processes handed over.

DuckDB runs here, in the CLI/REPL process, never in the training process (which only
takes the snapshots, see ``probe.agent.snapshot``). A :class:`Workspace` is one locked-down
in-memory DuckDB connection for one query: one thread, a memory limit, external access,
Python replacement scans and extension auto-loading off, then the configuration locked.
Each rank's snapshot is registered under private names (``__t<i>__schema__table``, typed
views casting to the declared column types); ``pushdown.rename_tables`` points a
per-rank query at them. ``execute`` runs the final query with a timeout (DuckDB is
interrupted; a query that ignores the interrupt is abandoned on its thread) and a row
cap, and ``interrupt`` stops it from another thread (the REPL's Ctrl-C).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

from probe._errors import QueryError, exception_text
from probe.util.wire import WireError, check_table

from .columns import SLOT, concat_snapshots, is_simple_type, quote, raw_columns, typed_select


GRACE_S = 2.0  # after the timeout interrupts DuckDB, how long it may take to notice before the query is abandoned


@dataclass
class Result:
    columns: list[str]
    types: list[str]
    rows: list[list]
    elapsed: float = 0.0
    truncated: bool = False
    meta: dict = field(default_factory=dict)


def connect(memory_limit: str | None = None):
    """A locked-down in-memory DuckDB connection (configuration not yet locked)."""
    import duckdb

    if memory_limit is None:
        from probe.config import setting

        memory_limit = setting("PROBE_QUERY_MEMORY")
    return duckdb.connect(
        ":memory:",
        config={
            "threads": 1,
            "memory_limit": memory_limit,
            "enable_external_access": False,
            "python_enable_replacements": False,
            "autoinstall_known_extensions": False,
            "autoload_known_extensions": False,
            "temp_directory": "",  # never spill into the working directory (.tmp/duckdb_temp_*): stay in memory
        },
    )


class Workspace:
    """One query's DuckDB connection holding the snapshots of one or more ranks."""

    def __init__(self, memory_limit: str | None = None, timeout: float | None = None):
        """``timeout``: seconds this workspace's set-up may take (loading the snapshots, the views and the tables
        computed per rank, ``run``); past it DuckDB is interrupted, whatever statement runs. Each query then
        has its own timeout (``execute``)."""
        self.con = connect(memory_limit)
        self._lock = threading.Lock()
        self._cancelled = False
        self._abandoned = False
        self._locked = False
        self._expired = threading.Event()
        self._timeout = timeout
        self._timer = None
        if timeout:
            self._timer = threading.Timer(timeout, self._expire)
            self._timer.daemon = True
            self._timer.start()
        self.meta: dict = {}  # what the caller wants to remember about the snapshots (see cli.query_runner)
        self.tables: dict[int, dict[str, str]] = {}  # rank slot -> {schema.table: typed view name}

    def _expire(self) -> None:
        self._expired.set()
        with contextlib.suppress(Exception):
            self.con.interrupt()

    @property
    def expired(self) -> bool:
        """Whether the set-up deadline passed (DuckDB was interrupted for it)."""
        return self._expired.is_set()

    def stopped(self) -> QueryError:
        """The one sentence for a workspace whose deadline passed."""
        return QueryError(
            f"the query ran past its {self._timeout:g} s timeout and was stopped; narrow it or raise --timeout."
        )

    def run(self, sql: str):
        """One set-up statement (a view, a table computed per rank) under the workspace's deadline."""
        import duckdb

        if self._expired.is_set():
            raise self.stopped()
        try:
            return self.con.execute(sql)
        except duckdb.Error:
            if self._expired.is_set():
                raise self.stopped() from None
            raise

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._abandoned:
            return
        with contextlib.suppress(Exception):
            self.con.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _register(self, slot: int, full: str, arrays: dict, spec: list) -> str:
        try:  # names and types reach SQL below: only the allow-list's, whoever sent them (a snapshot, a record)
            check_table(full, [(name, typ) for name, typ, *_ in spec])
        except WireError as exc:
            raise QueryError(f"refused a table from the process: {exc}.") from None
        base = full.replace(".", "__")
        raw, typed = f"__r{slot}__{base}", f"__t{slot}__{base}"
        self.con.register(raw, arrays)
        self.run(f"CREATE VIEW {quote(typed)} AS {typed_select(spec, raw)}")
        self.tables.setdefault(slot, {})[full] = typed
        return typed

    def load_snapshot(self, slot: int, decoded: dict) -> None:
        """Register a decoded ``probe.util.wire`` message's tables for rank slot ``slot``."""
        for full, t in decoded["tables"].items():
            arrays, spec = {}, []
            for name, c in t["columns"].items():
                arrays[name] = c["data"]
                has_nulls = c["valid"] is not None and c["kind"] != "str"
                if has_nulls:
                    arrays["__valid__" + name] = c["valid"]
                spec.append((name, c["type"], c["kind"], has_nulls))
            self._register(slot, full, arrays, spec)

    def load_slots(self, decoded: list, ranks: list) -> None:
        """Every rank's snapshot at once: one combined table per table (``concat_snapshots``), and ``__slots``
        (``__slot``, ``__rank``) naming the rank of each slot; ``slot_query`` then runs a per-rank query for all."""
        import numpy as np

        self.load_snapshot(0, concat_snapshots(decoded))
        self.con.register(
            "__slots_raw",
            {
                SLOT: np.arange(len(ranks), dtype="<i8"),
                "__rank": np.array([-1 if r is None else int(r) for r in ranks], dtype="<i8"),
            },
        )
        self.con.execute(
            f'CREATE VIEW "__slots" AS SELECT {SLOT}, CASE WHEN "__rank" >= 0 THEN CAST("__rank" AS INTEGER) END '
            'AS "__rank" FROM "__slots_raw"'
        )

    def load_tables(self, slot: int, tables: dict) -> None:
        """Register in-memory tables ``{schema.table: ([(column, type)], {column: values})}``."""
        for full, (columns, data) in tables.items():
            arrays, spec = raw_columns(columns, data)
            self._register(slot, full, arrays, spec)

    def create_view(self, name: str, sql: str) -> None:
        """``schema.table`` (or a bare name) as a view over ``sql``."""
        if "." in name:
            schema, short = name.split(".", 1)
            self.con.execute(f"CREATE SCHEMA IF NOT EXISTS {quote(schema)}")
            self.con.execute(f"CREATE OR REPLACE VIEW {quote(schema)}.{quote(short)} AS {sql}")
        else:
            self.con.execute(f"CREATE OR REPLACE VIEW {quote(name)} AS {sql}")

    def columns_of(self, relation: str) -> list[tuple[str, str]]:
        cur = self.con.execute(f"SELECT * FROM {relation} LIMIT 0")
        return [(d[0], str(d[1])) for d in cur.description or []]

    def interrupt(self) -> None:
        """Stop the running query (or the next one) from another thread."""
        with self._lock:
            self._cancelled = True
        with contextlib.suppress(Exception):
            self.con.interrupt()

    def execute(self, sql: str, *, max_rows: int = 10000, timeout: float = 10.0) -> Result:
        """Run ``sql`` (already guarded) and return at most ``max_rows`` rows; the configuration is locked first."""
        import duckdb

        if self._timer is not None:  # set-up is over: from here each query has its own timeout
            self._timer.cancel()
            if self._expired.is_set():
                raise self.stopped()
        if not self._locked:  # several queries may run on one workspace (probe doctor's rules)
            self.con.execute("SET lock_configuration = true")
            self._locked = True
        t0 = time.perf_counter()
        timed_out = threading.Event()
        box: dict = {}

        def run():
            try:
                cur = self.con.execute(sql)
                rows = cur.fetchmany(max_rows + 1)
                box["value"] = (cur.description or [], rows)
            except BaseException as exc:  # handed to the waiting thread
                box["error"] = exc

        def on_timeout():
            timed_out.set()
            with contextlib.suppress(Exception):
                self.con.interrupt()

        if self._cancelled:
            raise QueryError("the query was cancelled.")
        worker = threading.Thread(target=run, name="probe-duckdb", daemon=True)
        timer = threading.Timer(timeout, on_timeout)
        timer.daemon = True
        worker.start()
        timer.start()
        try:
            worker.join(timeout + GRACE_S)
        finally:
            timer.cancel()
        stopped = f"the query ran past its {timeout:g} s timeout and was stopped; narrow it or raise --timeout."
        if worker.is_alive():  # DuckDB did not notice the interrupt (e.g. building one huge list value)
            self.interrupt()
            self._abandoned = True  # closing the connection would wait for the query: leave it to process exit
            err = QueryError(stopped)
            err.abandoned = True  # the CLI exits at once instead of waiting for DuckDB (see cli.plumbing.main)
            raise err
        error = box.get("error")
        if error is not None:
            if self._cancelled:
                raise QueryError("the query was cancelled.") from None
            if timed_out.is_set() or isinstance(error, duckdb.InterruptException):
                raise QueryError(stopped) from None
            if isinstance(error, duckdb.OutOfMemoryException):
                raise QueryError(
                    "the query needs more memory than PROBE_QUERY_MEMORY allows (DuckDB runs in this client); "
                    "narrow it, or raise PROBE_QUERY_MEMORY."
                ) from None
            if isinstance(error, duckdb.Error):
                msg = str(error).strip().splitlines()[0]
                raise QueryError(f"DuckDB refused the query: {msg}") from None
            if isinstance(error, MemoryError):
                raise QueryError(
                    "the query ran out of memory; narrow it (PROBE_QUERY_MEMORY sets DuckDB's limit)."
                ) from None
            if isinstance(error, Exception):  # e.g. a value Python cannot hold: the query's doing, one sentence
                raise QueryError(f"the query's result could not be read ({exception_text(error)}).") from None
            raise error
        desc, rows = box["value"]
        return Result(
            columns=[d[0] for d in desc],
            types=[str(d[1]) for d in desc],
            rows=[list(r) for r in rows[:max_rows]],
            elapsed=time.perf_counter() - t0,
            truncated=len(rows) > max_rows,
        )


def execute(
    sql: str, tables: dict, *, max_rows: int = 10000, timeout: float = 10.0, memory_limit: str | None = None
) -> Result:
    """Run ``sql`` (already guarded) over in-memory ``tables``
    (``{schema.table: ([(column, type)], {column: values})}``).

    The tables are visible under their own names. Used by tests and benchmarks; the CLI
    goes through ``federate`` with snapshots received from the ranks.
    """
    from .pushdown import rename_tables_sql

    with Workspace(memory_limit) as ws:
        ws.load_tables(0, tables)
        return ws.execute(rename_tables_sql(sql, ws.tables.get(0, {})), max_rows=max_rows, timeout=timeout)


def register_result(con, name: str, result: Result, extra: dict | None = None) -> None:
    """Load a Result into ``con`` as view ``name``, with its types.

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
    exprs = [quote(c) for c in (extra or {})]
    for col, typ in zip(result.columns, result.types):
        simple = is_simple_type(typ)
        exprs.append(
            f"TRY_CAST({quote(col)} AS {typ}) AS {quote(col)}"
            if simple
            else f"CAST({quote(col)} AS VARCHAR) AS {quote(col)}"
        )
    con.execute(f"CREATE OR REPLACE VIEW {quote(name)} AS SELECT {', '.join(exprs) or '*'} FROM {raw}")
