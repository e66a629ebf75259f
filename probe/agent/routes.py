"""HTTP routes of the read tier: health, snapshot (the server side of a query), backtrace, tables.

Other rooms add their own routes (actions, eval) with ``@route`` the same way.
"""

from __future__ import annotations

import reprlib
import threading

from . import state
from .routing import Binary, Request, route
from .server import requests_served
from .._errors import QueryError
from ..tables.python import frame_row, walk_stacks
from ..tables.registry import all_tables, version
from ..util.procfs import native_id
from ..util.redact import redact

__all__ = ["snapshot", "safe_repr", "schema_identity"]


@route("GET", "/health")
def health(req: Request) -> dict:
    return dict(state.status(), requests=requests_served())


@route("POST", "/snapshot")
def snapshot(req: Request) -> Binary:
    """The columns a client's query needs, in the binary form of ``probe.util.wire``; see ``probe.agent.snapshot``.

    The query itself (SQL, DuckDB) runs in the client: nothing here parses SQL.
    """
    from .snapshot import take

    entry = state.info()
    meta = {"pid": entry.get("pid"), "rank": entry.get("rank"), "host": entry.get("host"), **schema_identity(entry)}
    return Binary(take(req.body, meta), "application/x-probe-columns")


def schema_identity(entry: dict | None = None) -> dict:
    """What a client's cached schema is valid for: this process (its start time) and the registry's version.

    Sent with every snapshot and with ``/tables``, so a client can plan with a cached schema and
    one request per query, and notice a restart or a newly registered table in the answer.
    """
    entry = state.info() if entry is None else entry
    return {"started_at": entry.get("started_at"), "schema_version": version()}


_tables_cache: dict = {}


@route("GET", "/tables")
def tables(req: Request) -> Binary:
    """The table declarations, encoded once per registry state (every query's plan asks for them)."""
    import json

    ident = schema_identity()  # read before the tables: a table registered meanwhile makes it stale, never newer
    current = (tuple(all_tables()), ident["schema_version"], ident["started_at"])
    cached = _tables_cache.get("body")
    if cached is None or _tables_cache.get("key") != current:
        doc = {
            **ident,
            "tables": [
                {
                    "name": t.name,
                    "description": t.description,
                    "kind": t.kind,
                    "examples": list(t.examples),
                    "columns": [{"name": c.name, "type": c.type, "description": c.description} for c in t.columns],
                }
                for t in current[0]
            ],
        }
        cached = json.dumps(doc).encode()
        _tables_cache.update(key=current, body=cached)
    return Binary([cached], "application/json")


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
        if want not in (None, "") and want not in (name, str(ident), str(native_id(thread) or "")):
            continue
        rows = []
        for depth, frame in enumerate(frames):
            func, file, lineno, line = frame_row(frame)
            row = {"depth": depth, "func": func, "file": file, "lineno": lineno, "line": line}
            if with_locals:
                row["locals"] = {k: redact(k, safe_repr(v)) for k, v in list(frame.f_locals.items())[:40]}
            rows.append(row)
        threads.append(
            {
                "thread_id": ident,
                "native_id": native_id(thread),
                "name": name,
                "is_main": is_main,
                "daemon": getattr(thread, "daemon", None),
                "frames": rows,
            }
        )
    threads.sort(key=lambda t: (not t["is_main"], (t["name"] or "").startswith("probe-"), t["name"] or ""))
    if want not in (None, "") and not threads:
        names = ", ".join(sorted({t.name for t in threading.enumerate()}))
        raise QueryError(f"no thread named or numbered {want!r}; threads: {names}.")
    return {"source": "probe", "pid": state.info().get("pid"), "rank": state.info().get("rank"), "threads": threads}
