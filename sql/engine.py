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

import re
import threading
import time
from dataclasses import asdict, dataclass, field

from probe._errors import QueryError
from probe.util.wire import WireError, check_table, object_column

__all__ = ["Result", "Workspace", "execute", "connect", "register_result", "typed_select", "concat_snapshots", "SLOT"]

_SIMPLE_TYPES = (
    "BIGINT",
    "INTEGER",
    "DOUBLE",
    "VARCHAR",
    "BOOLEAN",
    "TIMESTAMP",
    "FLOAT",
    "SMALLINT",
    "TINYINT",
    "HUGEINT",
    "UBIGINT",
    "UINTEGER",
    "DATE",
    "DECIMAL",
    "TIMESTAMP WITH TIME ZONE",
)
_SIMPLE_TYPE = re.compile(r"^[A-Z ]+(\(\d{1,2}(, ?\d{1,2})?\))?$")  # DECIMAL(18,3): a type word, never more SQL
_FLOAT_TYPES = ("DOUBLE", "FLOAT", "REAL")
SLOT = "__slot"  # the column saying which rank's snapshot a row of a combined table came from
GRACE_S = 2.0  # after the timeout interrupts DuckDB, how long it may take to notice before the query is abandoned


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
        return cls(
            d["columns"], d["types"], d["rows"], d.get("elapsed", 0.0), d.get("truncated", False), d.get("meta", {})
        )


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


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def typed_select(columns, source: str) -> str:
    """SELECT casting the raw columns of ``source`` to their declared types.

    ``columns`` is ``[(name, type, kind, has_nulls)]``; a numeric column with NULLs reads its
    ``__valid__<name>`` companion. TIMESTAMP columns arrive as epoch seconds.

    DuckDB's numpy scan reads NaN as NULL; a float array here has no NULLs of its own (those
    are in the companion), so a NULL read from a DOUBLE column is a NaN and is put back.

    >>> typed_select([("t", "TIMESTAMP", "f8", False), ("s", "VARCHAR", "str", True)], "raw")
    'SELECT make_timestamp(CAST(round("t" * 1000000) AS BIGINT)) AS "t", CAST("s" AS VARCHAR) AS "s" FROM "raw"'
    >>> print(typed_select([("x", "DOUBLE", "f8", True)], "raw"))
    SELECT CASE WHEN "__valid__x" THEN coalesce(CAST("x" AS DOUBLE), CAST('NaN' AS DOUBLE)) END AS "x" FROM "raw"
    """
    exprs = []
    for name, typ, kind, has_nulls in columns:
        q = _quote(name)
        if kind == "str" and typ not in ("VARCHAR",):
            expr = f"TRY_CAST({q} AS {typ})"
        elif typ == "TIMESTAMP":
            expr = f"make_timestamp(CAST(round({q} * 1000000) AS BIGINT))"
        elif kind == "f8" and typ in _FLOAT_TYPES:
            expr = f"coalesce(CAST({q} AS {typ}), CAST('NaN' AS {typ}))"
        else:
            expr = f"CAST({q} AS {typ})"
        if has_nulls and kind != "str":
            expr = f"CASE WHEN {_quote('__valid__' + name)} THEN {expr} END"
        exprs.append(f"{expr} AS {q}")
    return f"SELECT {', '.join(exprs) or '1 AS _empty'} FROM {_quote(source)}"


def _raw_columns(columns: list, data: dict) -> tuple[dict, list]:
    """From ``[(name, type)]`` and ``{name: values}`` (a table generator's output): numpy arrays and typed_select's
    spec."""
    import numpy as np

    arrays, spec = {}, []
    for name, typ in columns:
        values = data[name]
        kind, valid = None, None
        if isinstance(values, np.ndarray) and values.dtype.kind in "fiub":
            kind, data_, mask = "f8" if values.dtype.kind == "f" else "i8", np.ma.getdata(values), np.ma.getmask(values)
            valid = None if mask is np.ma.nomask else ~mask
        elif typ != "VARCHAR":  # Python values: None is NULL, NaN stays a value (as on the wire)
            kind, data_, valid = object_column(list(values), typ)
        if kind is not None and kind != "str":
            has_nulls = valid is not None and not valid.all()
            arrays[name] = data_
            if has_nulls:
                arrays["__valid__" + name] = valid
            spec.append((name, typ, kind, has_nulls))
            continue
        arr = np.empty(len(values), dtype=object)
        arr[:] = list(values)
        arrays[name] = arr
        spec.append((name, typ, "obj", False))
    return arrays, spec


def _concat_column(cols: list) -> dict:
    """One decoded column (``{"type", "kind", "data", "valid"}``) from the same column of several snapshots."""
    import numpy as np

    kinds = {c["kind"] for c in cols}
    texts = kinds & {"str", "dict"}
    if texts and kinds - texts:  # numbers on some ranks, text on others: all as text (typed_select casts it back)
        datas = []
        for c in cols:
            if c["kind"] in ("str", "dict"):
                datas.append(c["data"])
                continue
            out = np.empty(len(c["data"]), dtype=object)
            out[:] = [str(x) for x in c["data"].tolist()]
            if c["valid"] is not None:
                out[~c["valid"]] = None
            datas.append(out)
        return {"type": cols[0]["type"], "kind": "str", "data": np.concatenate(datas), "valid": None}
    if texts:
        return {
            "type": cols[0]["type"],
            "kind": "str" if "str" in kinds else "dict",
            "data": np.concatenate([c["data"] for c in cols]),
            "valid": None,
        }
    kind = "f8" if "f8" in kinds else "i8" if "i8" in kinds else "b1"
    dtype = {"f8": "<f8", "i8": "<i8", "b1": "|b1"}[kind]
    data = np.concatenate([np.asarray(c["data"], dtype=dtype) for c in cols])
    valid = None
    if any(c["valid"] is not None for c in cols):
        valid = np.concatenate([c["valid"] if c["valid"] is not None else np.ones(len(c["data"]), bool) for c in cols])
    return {"type": cols[0]["type"], "kind": kind, "data": data, "valid": valid}


def concat_snapshots(decoded: list) -> dict:
    """Several ranks' decoded snapshots (``probe.util.wire.decode``) as one, each table with a ``__slot`` column.

    Row ``k`` of a combined table came from ``decoded[slot[k]]``; a table or column that some
    snapshots lack is taken from those that have it. One registration per table then serves
    every rank (``Workspace.load_snapshot``), however many ranks answered.

    >>> import numpy as np
    >>> one = lambda v: {"tables": {"t.x": {"rows": len(v), "columns": {"a": {"type": "BIGINT", "kind": "i8",
    ...                  "data": np.array(v), "valid": None}}}}}
    >>> t = concat_snapshots([one([1, 2]), one([3])])["tables"]["t.x"]
    >>> t["rows"], t["columns"]["a"]["data"].tolist(), t["columns"]["__slot"]["data"].tolist()
    (3, [1, 2, 3], [0, 0, 1])
    """
    import numpy as np

    names: dict = {}
    for d in decoded:
        for name, t in d["tables"].items():
            names.setdefault(name, {}).update({c: v["type"] for c, v in t["columns"].items()})
    out = {}
    for name, columns in names.items():
        present = [(i, d["tables"][name]) for i, d in enumerate(decoded) if name in d["tables"]]
        cols = {}
        for col, typ in columns.items():
            parts = []
            for _, t in present:
                c = t["columns"].get(col)
                if c is None:  # an older rank without this column: NULLs
                    c = {
                        "type": typ,
                        "kind": "f8",
                        "data": np.full(t["rows"], np.nan),
                        "valid": np.zeros(t["rows"], bool),
                    }
                parts.append(c)
            cols[col] = _concat_column(parts)
        slot = (
            np.concatenate([np.full(t["rows"], i, dtype="<i8") for i, t in present]) if present else np.zeros(0, "<i8")
        )
        cols[SLOT] = {"type": "BIGINT", "kind": "i8", "data": slot, "valid": None}
        out[name] = {"rows": len(slot), "columns": cols}
    return {"meta": {}, "tables": out}


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
        try:
            self.con.interrupt()
        except Exception:
            pass

    @property
    def expired(self) -> bool:
        """Whether the set-up deadline passed (DuckDB was interrupted for it)."""
        return self._expired.is_set()

    def _stopped(self) -> QueryError:
        return QueryError(
            f"the query ran past its {self._timeout:g} s timeout and was stopped; narrow it or raise --timeout."
        )

    def stopped(self) -> QueryError:
        """The one sentence for a workspace whose deadline passed."""
        return self._stopped()

    def run(self, sql: str):
        """One set-up statement (a view, a table computed per rank) under the workspace's deadline."""
        import duckdb

        if self._expired.is_set():
            raise self._stopped()
        try:
            return self.con.execute(sql)
        except duckdb.Error:
            if self._expired.is_set():
                raise self._stopped() from None
            raise

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._abandoned:
            return
        try:
            self.con.close()
        except Exception:
            pass

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
        self.run(f"CREATE VIEW {_quote(typed)} AS {typed_select(spec, raw)}")
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
            arrays, spec = _raw_columns(columns, data)
            self._register(slot, full, arrays, spec)

    def create_view(self, name: str, sql: str) -> None:
        """``schema.table`` (or a bare name) as a view over ``sql``."""
        if "." in name:
            schema, short = name.split(".", 1)
            self.con.execute(f"CREATE SCHEMA IF NOT EXISTS {_quote(schema)}")
            self.con.execute(f"CREATE OR REPLACE VIEW {_quote(schema)}.{_quote(short)} AS {sql}")
        else:
            self.con.execute(f"CREATE OR REPLACE VIEW {_quote(name)} AS {sql}")

    def columns_of(self, relation: str) -> list[tuple[str, str]]:
        cur = self.con.execute(f"SELECT * FROM {relation} LIMIT 0")
        return [(d[0], str(d[1])) for d in cur.description or []]

    def interrupt(self) -> None:
        """Stop the running query (or the next one) from another thread."""
        with self._lock:
            self._cancelled = True
        try:
            self.con.interrupt()
        except Exception:
            pass

    def execute(self, sql: str, *, max_rows: int = 10000, timeout: float = 10.0) -> Result:
        """Run ``sql`` (already guarded) and return at most ``max_rows`` rows; the configuration is locked first."""
        import duckdb

        if self._timer is not None:  # set-up is over: from here each query has its own timeout
            self._timer.cancel()
            if self._expired.is_set():
                raise self._stopped()
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
            try:
                self.con.interrupt()
            except Exception:
                pass

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
    exprs = [_quote(c) for c in (extra or {})]
    for col, typ in zip(result.columns, result.types):
        simple = _SIMPLE_TYPE.match(str(typ)) is not None and str(typ).split("(")[0] in _SIMPLE_TYPES
        exprs.append(
            f"TRY_CAST({_quote(col)} AS {typ}) AS {_quote(col)}"
            if simple
            else f"CAST({_quote(col)} AS VARCHAR) AS {_quote(col)}"
        )
    con.execute(f"CREATE OR REPLACE VIEW {_quote(name)} AS SELECT {', '.join(exprs) or '*'} FROM {raw}")
