"""HTTP routes of the read tier: health, snapshot (the server side of a query), backtrace, tables, and ``GET
/profile``. Other rooms add their own routes (actions, eval) with ``@route`` the same way.

``GET /profile`` samples every thread's Python stack for a few seconds (a flamegraph's data) on the request's
server thread (``sample_stacks``): stacks are keyed by their code objects while sampling and turned into text
once at the end, and the thread sleeps between samples, so the training thread keeps the GIL. A profile is
charged to its listener's share (``snapshot.Lane``) as it samples and pauses while the share is spent; one runs
at a time per listener. The answer is collapsed stacks, root first, with a sample count each.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from itertools import islice

from .._core import state
from .server import Binary, Request, requests_served, route
from .snapshot import lane, served, take
from .._errors import QueryError
from ..config import setting
from ..tables.python import frame_row, thread_roots
from ..tables.registry import all_tables, version
from ..util import validate as v
from ..util.objects import bounded_repr
from ..util.procfs import native_id
from ..util.printable import redact, frame_text


@route("GET", "/health")
def health(req: Request) -> dict:
    return dict(state.status(), requests=requests_served())


@route("POST", "/snapshot")
def snapshot(req: Request) -> Binary:
    """The columns a client's query needs, in the binary form of ``probe.util.wire``; see ``probe.agent.snapshot``.

    The query itself (SQL, DuckDB) runs in the client: nothing here parses SQL.
    """
    entry = state.info()
    meta = {"pid": entry.get("pid"), "rank": entry.get("rank"), "host": entry.get("host"), **schema_identity(entry)}
    return Binary(take(req.body, meta, req.client.get("transport")), "application/x-probe-columns")


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


# What one backtrace may cost: the threads shown with their stacks (the rest are counted by where they are),
# the frames shown per thread (the innermost), the locals shown per frame, and the wall time its locals may take.
MAX_THREADS = 64
MAX_DEPTH = 128
MAX_LOCALS = 40
LOCALS_DEADLINE_S = 1.0
_SLICE = 16  # threads walked between two releases of the GIL (the training thread takes it meanwhile)


@route("GET", "/backtrace")
def backtrace(req: Request) -> dict:
    """Every thread's stack, innermost frame first; served and charged on the client's lane (``snapshot.served``).

    Bounded by the thread count: at most ``MAX_THREADS`` threads with ``MAX_DEPTH`` frames each, the
    others counted by their innermost frame in ``left_out``; locals are bounded reprs
    (``probe.util.objects``) for ``LOCALS_DEADLINE_S`` at most, and the GIL is let go between threads."""
    want = req.param("thread")
    want = None if want in (None, "") else str(want)
    with_locals = str(req.param("locals", "")).lower() in ("1", "true", "yes")
    timeout = v.seconds(req.param("wait"), "wait", default=setting("PROBE_QUERY_TIMEOUT"))  # in line, at most
    entry = state.info()
    with served(req.client.get("transport"), timeout, "backtrace"):
        doc = {"source": "probe", "pid": entry.get("pid"), "rank": entry.get("rank")}
        doc.update(_stacks(want, with_locals))
    if want is not None and not doc["threads"]:
        names = sorted({t.name for t in threading.enumerate()})
        more = f" and {len(names) - 20} more" if len(names) > 20 else ""
        raise QueryError(f"no thread named or numbered {want!r}; threads: {', '.join(names[:20])}{more}.")
    return doc


def _stacks(want: str | None, with_locals: bool) -> dict:
    roots = []
    for ident, thread, is_main, frame in thread_roots(frozenset({threading.get_ident()})):
        name = thread.name if thread else None
        if want is None or want in (name, str(ident), str(native_id(thread) or "")):
            roots.append((ident, thread, is_main, frame, name))
    roots.sort(key=lambda r: (not r[2], (r[4] or "").startswith("probe-"), r[4] or ""))
    shown, rest = roots[:MAX_THREADS], roots[MAX_THREADS:]
    deadline = time.monotonic() + LOCALS_DEADLINE_S
    out: dict = {"threads": []}
    for i, (ident, thread, is_main, frame, name) in enumerate(shown):
        if i and i % _SLICE == 0:
            time.sleep(0)  # ok-sleep: lets the training thread have the GIL between threads
        rows = []
        f = frame
        while f is not None and len(rows) < MAX_DEPTH:
            func, file, lineno, line = frame_row(f)
            row = {"depth": len(rows), "func": func, "file": file, "lineno": lineno, "line": line}
            if with_locals:
                if time.monotonic() < deadline:
                    row["locals"] = _locals(f)
                else:
                    out["locals_left_out"] = LOCALS_DEADLINE_S
            rows.append(row)
            f = f.f_back
        t = {
            "thread_id": ident,
            "native_id": native_id(thread),
            "name": name,
            "is_main": is_main,
            "daemon": getattr(thread, "daemon", None),
            "frames": rows,
        }
        outer = 0
        while f is not None:
            outer, f = outer + 1, f.f_back
        if outer:
            t["frames_left_out"] = outer
        out["threads"].append(t)
    if rest:
        out["left_out"] = _left_out(rest)
    return out


def _locals(frame) -> dict:
    loc = frame.f_locals
    return {str(k): redact(str(k), bounded_repr(value)) for k, value in islice(loc.items(), MAX_LOCALS)}


def _left_out(rest: list) -> dict:
    """The threads past ``MAX_THREADS``, counted by their innermost frame (the ten most common places)."""
    where: dict = {}
    for i, (_, _, _, frame, _) in enumerate(rest):
        if i and i % (_SLICE * 16) == 0:
            time.sleep(0)  # ok-sleep: lets the training thread have the GIL
        key = (frame.f_code, frame.f_lineno)
        where[key] = where.get(key, 0) + 1
    top = sorted(where.items(), key=lambda kv: -kv[1])[:10]
    return {
        "threads": len(rest),
        "limit": MAX_THREADS,
        "where": [
            {"func": code.co_name, "file": code.co_filename, "lineno": lineno or code.co_firstlineno, "threads": n}
            for (code, lineno), n in top
        ],
    }


MAX_SECONDS = 60.0
MAX_HZ = 250.0
DEFAULT_HZ = 100.0
MAX_STACKS = 20000  # distinct stacks kept; further new ones are counted as dropped
MAX_SAMPLE_DEPTH = 256  # frames of one sampled stack (a backtrace shows MAX_DEPTH)
_CHARGE_EVERY = 10  # samples between two charges to the lane


def _label(code) -> str:
    """``func (file.py:first line)``: one box per function, whichever line it is on."""
    name = getattr(code, "co_qualname", None) or code.co_name
    return frame_text(f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})")


def sample_stacks(seconds: float, hz: float = DEFAULT_HZ, exclude: frozenset = frozenset(), lane=None) -> dict:
    """Sample all threads but ``exclude`` for ``seconds`` at ``hz``; return collapsed stacks with counts.

    With ``lane`` (``Lane``), the thread's CPU time is charged to it every few samples, and
    sampling pauses while its share is spent."""
    counts: dict[tuple, int] = {}
    charged = 0  # CPU time of this thread charged to the lane so far
    paced = 0.0
    dropped = 0
    names: dict[int, str] = {}
    interval = 1.0 / hz
    start = time.monotonic()
    deadline = start + seconds
    next_at = start
    samples = 0
    while True:
        now = time.monotonic()
        if now >= deadline:
            break
        if samples % 50 == 0:  # threads come and go; their names are cheap to refresh now and then
            names.update({t.ident: t.name for t in threading.enumerate() if t.ident is not None})
        frames = sys._current_frames()
        for ident, frame in frames.items():
            if ident in exclude:
                continue
            codes = []
            while frame is not None and len(codes) < MAX_SAMPLE_DEPTH:
                codes.append(frame.f_code)
                frame = frame.f_back
            key = (ident, tuple(codes))
            if key in counts:
                counts[key] += 1
            elif len(counts) < MAX_STACKS:
                counts[key] = 1
            else:
                dropped += 1
        del frames, frame
        samples += 1
        if lane is not None and samples % _CHARGE_EVERY == 0:
            spent = time.thread_time_ns()
            lane.charge(spent - charged)
            charged = spent
            pause = min(lane.wait_s(), deadline - time.monotonic())
            if pause > 0:
                time.sleep(pause)  # ok-sleep: the share is spent; the training thread has the GIL meanwhile
                paced += pause
                next_at = time.monotonic()
                continue
        next_at += interval
        pause = next_at - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # ok-sleep: the sampling interval; the GIL is free meanwhile
        else:
            next_at = time.monotonic()  # fell behind (a busy GIL): sample again at once, never in a burst
    elapsed = time.monotonic() - start
    if lane is not None:
        lane.charge(time.thread_time_ns() - charged)
    labels: dict = {}
    stacks: dict[str, int] = {}
    for (ident, codes), n in counts.items():
        parts = [frame_text(f"thread {names.get(ident, ident)}")]
        for code in reversed(codes):
            text = labels.get(code)
            if text is None:
                text = labels[code] = _label(code)
            parts.append(text)
        key = ";".join(parts)
        stacks[key] = stacks.get(key, 0) + n
    return {
        "samples": samples,
        "seconds": round(elapsed, 3),
        "hz": hz,
        "dropped": dropped,
        "paced_s": round(paced, 3),
        "stacks": sorted(([k, v] for k, v in stacks.items()), key=lambda kv: -kv[1]),
    }


@route("GET", "/profile")
def profile(req: Request) -> dict:
    seconds = v.number(
        req.param("seconds"), "seconds", default=5.0, minimum=0.0, maximum=MAX_SECONDS, exclusive_minimum=True
    )
    hz = v.number(req.param("hz"), "hz", default=DEFAULT_HZ, minimum=0.0, maximum=MAX_HZ, exclusive_minimum=True)
    wait = v.seconds(req.param("wait"), "wait", default=setting("PROBE_QUERY_TIMEOUT"))  # for the share, at most
    own = lane(req.client.get("transport"))
    if not own.profiling.acquire(blocking=False):
        raise QueryError("a profile is already running in this process; wait for it to finish and ask again.")
    try:
        own.paced(wait, "profile")
        doc = sample_stacks(seconds, hz, exclude=frozenset({threading.get_ident()}), lane=own)
    finally:
        own.profiling.release()
    entry = state.info()
    doc.update(source="probe", pid=entry.get("pid"), rank=entry.get("rank"))
    return doc
