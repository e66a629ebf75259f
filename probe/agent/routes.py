"""HTTP routes of the read tier: health, query, backtrace, tables.

Other rooms add their own routes (actions, eval) with ``@route`` the same way.
"""

from __future__ import annotations

import reprlib
import threading
import time

from . import state
from .._config import setting
from .._errors import QueryError
from ..util.errorlog import record_error
from .server import Request, route
from ..tables import builtin  # noqa: F401  (registers the built-in tables)
from ..tables.python import frame_row, walk_stacks
from ..tables.registry import Context, all_tables, get_table, to_columns

__all__ = ["run_query", "snapshot"]


@route("GET", "/health")
def health(req: Request) -> dict:
    return state.status()


def snapshot(names, ctx: Context) -> dict:
    """One snapshot per table: ``{name: ([(column, type)], {column: values})}``."""
    out = {}
    for name in names:
        tbl = get_table(name)
        try:
            data = to_columns(tbl, tbl.generator(ctx))
        except Exception as exc:
            record_error(f"table {name}", exc)
            raise QueryError(f"table {name} could not be read ({type(exc).__name__}: {exc}); see probe.errors.") from None
        out[name] = ([(c.name, c.type) for c in tbl.columns], data)
    return out


def run_query(sql: str, *, max_rows: int | None = None, timeout: float | None = None, ctx: Context | None = None,
              query_id: str | None = None):
    from probe.sql.engine import execute
    from probe.sql.guard import guard

    if not isinstance(sql, str) or not sql.strip():
        raise QueryError("no SQL given; pass a query such as \"SELECT * FROM probe.tables\".")
    guarded = guard(sql, [t.name for t in all_tables()])
    ctx = ctx or Context(exclude_threads=frozenset({threading.get_ident()}))
    t0 = time.perf_counter()
    tables = snapshot(guarded.tables, ctx)
    snap = time.perf_counter() - t0
    result = execute(
        guarded.sql,
        tables,
        max_rows=int(max_rows or setting("PROBE_MAX_ROWS")),
        timeout=float(timeout or setting("PROBE_QUERY_TIMEOUT")),
        memory_limit=setting("PROBE_QUERY_MEMORY"),
        query_id=query_id,
    )
    entry = state.info()
    result.meta = {"pid": entry.get("pid"), "rank": entry.get("rank"), "host": entry.get("host"),
                   "snapshot_time": ctx.time, "snapshot_s": snap, "tables": list(guarded.tables)}
    return result


@route("POST", "/query")
def query(req: Request) -> dict:
    max_rows = req.param("max_rows")
    timeout = req.param("timeout")
    try:
        max_rows = int(max_rows) if max_rows is not None else None
        timeout = float(timeout) if timeout is not None else None
    except (TypeError, ValueError):
        raise QueryError("max_rows must be an integer and timeout a number of seconds.") from None
    query_id = req.param("query_id")
    query_id = str(query_id) if query_id not in (None, "") else None
    return run_query(req.param("sql"), max_rows=max_rows, timeout=timeout, query_id=query_id).to_dict()


@route("POST", "/query/cancel")
def query_cancel(req: Request) -> dict:
    """Interrupt the running query that the client started with this ``query_id``."""
    from probe.sql.engine import cancel

    query_id = req.param("query_id")
    if query_id in (None, ""):
        raise QueryError("no query_id given; pass the query_id the query was sent with.")
    return {"query_id": str(query_id), "cancelled": cancel(str(query_id))}


@route("GET", "/tables")
def tables(req: Request) -> dict:
    return {"tables": [
        {"name": t.name, "description": t.description, "kind": t.kind, "examples": list(t.examples),
         "columns": [{"name": c.name, "type": c.type, "description": c.description} for c in t.columns]}
        for t in all_tables()
    ]}


_repr = reprlib.Repr()
_repr.maxstring = 80
_repr.maxother = 80
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 6


def safe_repr(value) -> str:
    """A short repr that never touches tensor data (no device sync) and never raises."""
    try:
        mod = type(value).__module__ or ""
        if mod.startswith("torch") and hasattr(value, "shape") and hasattr(value, "dtype"):
            return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
        if mod.startswith("numpy") and hasattr(value, "shape"):
            return f"ndarray(shape={value.shape}, dtype={value.dtype})"
        return _repr.repr(value)
    except Exception as exc:
        return f"<repr failed: {type(exc).__name__}>"


@route("GET", "/backtrace")
def backtrace(req: Request) -> dict:
    want = req.param("thread")
    with_locals = str(req.param("locals", "")).lower() in ("1", "true", "yes")
    threads = []
    for ident, thread, is_main, frames in walk_stacks(frozenset({threading.get_ident()})):
        name = thread.name if thread else None
        if want not in (None, "") and want not in (name, str(ident), str(getattr(thread, "native_id", ""))):
            continue
        rows = []
        for depth, frame in enumerate(frames):
            func, file, lineno, line = frame_row(frame)
            row = {"depth": depth, "func": func, "file": file, "lineno": lineno, "line": line}
            if with_locals:
                row["locals"] = {k: safe_repr(v) for k, v in list(frame.f_locals.items())[:40]}
            rows.append(row)
        threads.append({"thread_id": ident, "native_id": getattr(thread, "native_id", None), "name": name,
                        "is_main": is_main, "daemon": getattr(thread, "daemon", None), "frames": rows})
    threads.sort(key=lambda t: (not t["is_main"], (t["name"] or "").startswith("probe-"), t["name"] or ""))
    if want not in (None, "") and not threads:
        names = ", ".join(sorted({t.name for t in threading.enumerate()}))
        raise QueryError(f"no thread named or numbered {want!r}; threads: {names}.")
    return {"source": "probe", "pid": state.info().get("pid"), "rank": state.info().get("rank"), "threads": threads}
