"""Snapshots of the tables a client's query needs (only its columns, cheap filters applied), and what the read
routes may take from the training process (per listener, slots and a share of wall time).

This is all the query work the training process does. A client guards and plans its SQL, then asks for::

    {"tables": {"torch.steps": {"columns": ["step", "loss"],
                                "filter": {"op": ">", "col": "step", "value": 100}}}}

and gets the columns in the binary form of ``probe.util.wire``; DuckDB runs in the client. A filter is a
tree of ``{"and": [...]}``, ``{"or": [...]}`` and comparisons ``{"op": "=|!=|<|<=|>|>=|in|null|notnull",
"col": c, "value": v}``. It only narrows what is sent, conservatively: a row is dropped only when the filter
surely rejects it (the client runs the full query again), so a value it cannot compare cheaply is kept. No
SQL is parsed here. A snapshot larger than ``PROBE_SNAPSHOT_BYTES`` is refused before it is sent.

Snapshots, backtraces and profiles compete with the training thread for the GIL, so each listener has its
own ``Lane``: at most ``PROBE_MAX_SNAPSHOTS`` at once, and ``PROBE_SERVE_SHARE`` of wall time over
``PACE_WINDOW_S``, each request charged its thread's CPU time in full and the next waiting until that is
earned back (docs/security.md lists the limits). TCP clients spend TCP's lane, never the owner's.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager

from ..config import setting
from .._errors import QueryError, ProbeError
from ..tables.registry import Context, get_table, to_columns
from ..util import validate as v
from ..util.errorlog import record_error
from ..util.budget import Budget


_OPS = ("=", "!=", "<", "<=", ">", ">=", "in", "null", "notnull")
MAX_FILTER_NODES = 256
MAX_IN_VALUES = 1000


def _check_filter(node, columns: set, depth: int = 0, count: list | None = None) -> dict:
    count = count if count is not None else [0]
    count[0] += 1
    if depth > 32 or count[0] > MAX_FILTER_NODES:
        raise QueryError(
            f"the snapshot filter is too large (over {MAX_FILTER_NODES} nodes or 32 levels); send a simpler WHERE."
        )
    if not isinstance(node, dict):
        raise QueryError("a snapshot filter must be a JSON object; see the client's plan.")
    for key in ("and", "or"):
        if key in node:
            kids = node[key]
            if not isinstance(kids, list) or not kids:
                raise QueryError(f"a snapshot filter's {key!r} needs a non-empty list.")
            return {key: [_check_filter(k, columns, depth + 1, count) for k in kids]}
    op, col = node.get("op"), node.get("col")
    if op not in _OPS:
        raise QueryError(f"unknown snapshot filter operator {op!r}; use one of {', '.join(_OPS)}.")
    if col not in columns:
        raise QueryError(f"the snapshot filter names column {col!r}, which the table does not have.")
    value = node.get("value")
    if op == "in":
        if not isinstance(value, list) or len(value) > MAX_IN_VALUES:
            raise QueryError(f"a snapshot filter's 'in' needs a list of at most {MAX_IN_VALUES} values.")
        if not all(isinstance(x, (int, float, str, bool)) for x in value):
            raise QueryError("a snapshot filter compares with numbers, strings or booleans only.")
    elif op not in ("null", "notnull") and not isinstance(value, (int, float, str, bool)):
        raise QueryError("a snapshot filter compares with numbers, strings or booleans only.")
    return {"op": op, "col": col, "value": value}


def parse_request(body: dict) -> tuple[dict, float]:
    """``({table: (columns, filter)}, timeout)`` from a request body, validated; QueryError otherwise."""
    tables = body.get("tables")
    if not isinstance(tables, dict) or not tables:
        raise QueryError('no tables asked for; send {"tables": {"schema.table": {"columns": [...]}}}.')
    if len(tables) > 64:
        raise QueryError("a snapshot may name at most 64 tables.")
    out = {}
    for name, spec in tables.items():
        tbl = get_table(str(name))
        if tbl is None:
            raise QueryError(f"unknown table {name}; `probe PID tables` lists them.")
        spec = spec if isinstance(spec, dict) else {}
        known = tbl.column_names
        cols = spec.get("columns")
        if cols is None:
            cols = list(known)
        if not isinstance(cols, list) or not all(isinstance(c, str) for c in cols):
            raise QueryError(f"the columns of {name} must be a list of names.")
        bad = [c for c in cols if c not in known]
        if bad:
            raise QueryError(f"table {name} has no column {bad[0]!r}; its columns: {', '.join(known)}.")
        flt = spec.get("filter")
        out[tbl.name] = ([c for c in known if c in cols], None if flt is None else _check_filter(flt, set(known)))
    timeout = v.seconds(body.get("timeout"), "timeout", default=setting("PROBE_QUERY_TIMEOUT"))
    return out, timeout


def _compare(col, op: str, value, typ: str):
    """Keep-mask of one comparison; conservative (True where unsure)."""
    import numpy as np

    n = len(col)
    if isinstance(col, np.ma.MaskedArray):
        col = col.data  # a missing float holds NaN there: kept below, the client filters
    if op in ("null", "notnull"):
        if isinstance(col, np.ndarray) and col.dtype.kind in "iub":
            return np.full(n, op == "notnull")
        if isinstance(col, np.ndarray) and col.dtype.kind == "f":
            return np.ones(n, bool)  # NaN is a value in SQL, a NULL only in some tables: keep
        isnull = np.fromiter((x is None for x in col), bool, n)
        return isnull if op == "null" else ~isnull
    values = value if op == "in" else [value]
    if typ == "TIMESTAMP" or isinstance(value, bool) and typ != "BOOLEAN":
        return np.ones(n, bool)
    numeric = all(
        isinstance(x, (int, float)) and not isinstance(x, bool) or typ == "BOOLEAN" and isinstance(x, bool)
        for x in values
    )
    if isinstance(col, np.ndarray) and col.dtype.kind in "fiub":
        if not numeric:
            return np.ones(n, bool)
        arr = col
        if col.dtype.kind == "f" and typ in ("BIGINT", "INTEGER"):
            arr = np.rint(col)  # the client casts to an integer the same way
        with np.errstate(invalid="ignore"):
            if op == "in":
                keep = np.isin(arr, np.asarray(values, dtype=float))
            else:
                keep = {
                    "=": np.equal,
                    "!=": np.not_equal,
                    "<": np.less,
                    "<=": np.less_equal,
                    ">": np.greater,
                    ">=": np.greater_equal,
                }[op](arr, value)
        if col.dtype.kind == "f":
            keep |= np.isnan(col)  # DuckDB orders NaN above every number: never drop one here
        return keep
    if typ != "VARCHAR" or not all(isinstance(x, str) for x in values) or op not in ("=", "!=", "in"):
        return np.ones(n, bool)
    wanted = set(values)
    if op == "!=":
        return np.fromiter((x is not None and (not isinstance(x, str) or x != value) for x in col), bool, n)
    return np.fromiter((x is not None and (not isinstance(x, str) or x in wanted) for x in col), bool, n)


def apply_filter(columns: dict, types: dict, node: dict | None, n: int):
    """The keep-mask of ``node`` over ``columns`` (``{name: values}``), or None for no filter.

    >>> import numpy as np
    >>> apply_filter({"a": np.array([1, 2, 3])}, {"a": "BIGINT"}, {"op": ">", "col": "a", "value": 1}, 3).tolist()
    [False, True, True]
    >>> apply_filter({"s": ["x", None, "y"]}, {"s": "VARCHAR"},
    ...              {"or": [{"op": "=", "col": "s", "value": "y"}, {"op": "null", "col": "s"}]}, 3).tolist()
    [False, True, True]
    """
    import numpy as np

    if node is None:
        return None
    if "and" in node or "or" in node:
        masks = [apply_filter(columns, types, k, n) for k in node.get("and") or node.get("or")]
        out = masks[0]
        for m in masks[1:]:
            out = (out & m) if "and" in node else (out | m)
        return out
    col = columns[node["col"]]
    try:
        keep = _compare(col, node["op"], node.get("value"), types[node["col"]])
    except Exception:  # a value numpy cannot compare: keep every row, the client filters
        return np.ones(n, bool)
    return keep


def _select(data: dict, mask) -> dict:
    import numpy as np

    if mask is None:
        return data
    idx = np.flatnonzero(mask)
    out = {}
    for name, values in data.items():
        if isinstance(values, np.ndarray):
            out[name] = values[idx]
        else:
            out[name] = [values[i] for i in idx.tolist()]
    return out


def _one(name: str, columns: list, flt, ctx: Context) -> tuple:
    tbl = get_table(name)
    ctx.hints["columns"] = frozenset(columns)
    try:
        data = to_columns(tbl, tbl.generator(ctx))
    except Exception as exc:
        record_error(f"table {name}", exc)
        raise QueryError(f"table {name} could not be read ({type(exc).__name__}: {exc}); see probe.errors.") from None
    types = {c.name: c.type for c in tbl.columns}
    needed = set(columns) | (_filter_columns(flt) if flt else set())
    data = {c: data[c] for c in data if c in needed}
    n = len(next(iter(data.values()))) if data else 0
    if flt is not None and n:
        data = _select(data, apply_filter(data, types, flt, n))
    return (
        [(c, types[c]) for c in columns],
        {c: data[c] for c in columns},
        (len(next(iter(data.values()))) if data else n),
    )


def _filter_columns(node: dict) -> set:
    if "and" in node or "or" in node:
        return set().union(*(_filter_columns(k) for k in node.get("and") or node.get("or")))
    return {node["col"]}


def take(body: dict, meta: dict, transport: str = "unix") -> list:
    """The encoded snapshot the request asks for (buffers for ``probe.util.wire``), served on ``transport``'s
    lane (``served``: its share of wall time and its slots, charged the request's whole cost)."""
    from ..util.wire import encode

    try:
        wanted, timeout = parse_request(body)
    except BaseException:
        lane(transport).charge(time.thread_time_ns())  # a refused request costs its parsing too
        raise
    max_bytes = setting("PROBE_SNAPSHOT_BYTES")
    with served(transport, timeout, "snapshot"):
        ctx = Context(exclude_threads=frozenset({threading.get_ident()}))
        t0 = time.perf_counter()
        tables = {}
        for name, (columns, flt) in wanted.items():
            cols, data, _ = _one(name, columns, flt, ctx)
            tables[name] = (cols, data)
        meta = dict(meta, snapshot_time=ctx.time, snapshot_s=time.perf_counter() - t0)
        try:
            return encode(tables, meta, max_bytes=max_bytes)
        except OverflowError as exc:
            raise QueryError(
                f"the snapshot of {exc} is larger than PROBE_SNAPSHOT_BYTES ({max_bytes // 1048576} MiB); "
                "select fewer columns or add a WHERE on its columns (LIMIT is applied after the snapshot)."
            ) from None


PACE_WINDOW_S = 10.0  # PROBE_SERVE_SHARE is kept over this window (its share of it is the credit a lane starts with)


class BusyError(ProbeError):
    """A request could not be served within its timeout: its lane's share or slots were spent (HTTP 503)."""

    kind = "busy"
    exit_code = 3


class Lane:
    """One listener's slots and pace, made at first use (the settings are read then)."""

    def __init__(self, name: str):
        self.name = name
        self.lock = threading.Lock()
        self.profiling = threading.Lock()  # one profile at a time per lane
        self._slots: threading.BoundedSemaphore | None = None
        self._pace: Budget | None = None  # under ``lock``
        self._pace_at = 0  # when it last earned (time.monotonic_ns())

    def _bucket(self) -> Budget:
        """The pace's bucket, brought up to now (under ``lock``)."""
        now = time.monotonic_ns()
        if self._pace is None:
            # every cost charged in full (no cap on one charge nor on the debt): a client chooses what its
            # request costs (heavy filter trees over every table, a backtrace of every thread), so a cap
            # would be its discount
            self._pace = Budget(
                setting("PROBE_SERVE_SHARE"), burst_s=PACE_WINDOW_S, charge_cap=math.inf, debt_cap=math.inf
            )
        else:
            self._pace.earn(now - self._pace_at)
        self._pace_at = now
        return self._pace

    def wait_s(self) -> float:
        """Seconds until the lane's share has credit again (0 when it has)."""
        with self.lock:
            return self._bucket().wait_ns() / 1e9

    def paced(self, timeout: float, what: str = "request") -> None:
        """Wait until the lane's share has credit again; BusyError when that would take over ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            wait = self.wait_s()
            if wait <= 0:
                return
            if time.monotonic() + wait > deadline:
                # wait half the timeout before refusing (a client's own timeout ends with the other half): a client
                # that asks again at once after each refusal then costs the process one request per half timeout
                time.sleep(max(0.0, min(deadline - time.monotonic(), timeout / 2)))  # ok-sleep: waits in line
                raise BusyError(
                    f"the probe is pacing its readers: their {what}s may take {self._pace.share * 100:g} % of the "
                    f"training process's time (PROBE_SERVE_SHARE) and this one could not start within {timeout:g} s; "
                    "retry, ask less often, or raise PROBE_SERVE_SHARE in the training process."
                )
            time.sleep(min(wait, 0.25))  # ok-sleep: waiting for the share to refill

    def charge(self, cpu_ns: float) -> None:
        with self.lock:
            self._bucket().spend(cpu_ns)

    @contextmanager
    def slot(self, timeout: float):
        """One of the lane's ``PROBE_MAX_SNAPSHOTS`` slots, waited for up to ``timeout``; BusyError after."""
        with self.lock:
            if self._slots is None:
                self._slots = threading.BoundedSemaphore(setting("PROBE_MAX_SNAPSHOTS"))
            slots = self._slots
        if not slots.acquire(timeout=timeout):
            raise BusyError(
                f"the probe is busy: {setting('PROBE_MAX_SNAPSHOTS')} snapshots were running and this one waited "
                f"{timeout:g} s in line; retry, or raise PROBE_MAX_SNAPSHOTS in the training process."
            )
        try:
            yield
        finally:
            slots.release()


_LANES = {"unix": Lane("unix"), "tcp": Lane("tcp")}


def reset_lanes() -> None:
    """New lanes, made at their first use (the probe stopped): the next start's readers are paced and queued by
    its settings, not by those of the last start nor by what its readers spent."""
    for name in _LANES:
        _LANES[name] = Lane(name)


def lane(transport: str | None) -> Lane:
    """The lane of a listener: the owner's unix socket, or TCP (anything that is not the unix socket)."""
    return _LANES["unix" if transport == "unix" else "tcp"]


@contextmanager
def served(transport: str | None, timeout: float, what: str = "request"):
    """Serve one request on ``transport``'s lane: wait for its share and a slot (BusyError past ``timeout``),
    then charge the request's whole cost, answered or refused. The server runs one thread per request,
    so its thread's CPU time is what it cost (reading and parsing the body included)."""
    ln = lane(transport)
    try:
        ln.paced(timeout, what)
        with ln.slot(timeout):
            yield ln
    finally:
        ln.charge(time.thread_time_ns())
