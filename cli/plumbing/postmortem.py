"""Dead processes as targets: a pid or a rank that died answers from its post-mortem record.

Finding records: the record of a dead pid or of a job's dead ranks (``find``, ``job_records``), the records of
this host and of the shared registry (``list_records``), and how each process ended (``explain``,
``dump_only``, ``dead_records``: what ``probe list --dead`` shows). The training process only writes them
(``probe.postmortem``); reading one back as tables is ``records``'s.

``cli.plumbing.endpoint`` turns a dead pid with a record, or a dead rank of a job, into a Target
(``entry["postmortem"]`` holds the record's folder, ``target.record`` the ``records.Record``).
``Session.client`` hands such a target a :class:`RecordClient`, which answers
the read routes the commands use (``/health``, ``/tables``, ``/backtrace``, the snapshot
of ``/snapshot``) from the record, so ``query``, ``status``, ``doctor``,
``tables``, ``describe`` and ``backtrace`` run their usual path, DuckDB here, unchanged.
Anything else (actions, eval, profiles) gets one sentence: the process is gone.
"""

from __future__ import annotations

import os
import socket
import zipfile

from probe._errors import EndpointError, QueryError
from probe._runtime import runtime_dir
from probe.postmortem.record import load_tables, records_dir, shared_records_dir
from probe.postmortem.retention import alive, read_meta

from .records import Record


def is_postmortem(target) -> bool:
    """Whether ``target`` is a dead process answered by its post-mortem record."""
    return getattr(target, "record", None) is not None


def refine_refusal(exc: QueryError, targets) -> QueryError:
    """A query refused on one dead process's record: say which tables its record keeps."""
    if len(targets) != 1 or not is_postmortem(targets[0]) or not exc.table:
        return exc
    rec = targets[0].record
    return QueryError(
        f"{rec.describe()}; its post-mortem record keeps {', '.join(rec.stored) or 'no tables'} "
        f"(and the ranks.* views), not {exc.table}.",
        table=exc.table,
    )


class RecordClient:
    """The client of a dead process: the read routes answered from its record."""

    def __init__(self, target, timeout: float = 10.0, agent: str | None = None):
        self.target = target
        self.record = target.record
        self.timeout = timeout

    def get(self, path: str, timeout: float | None = None, **params) -> dict:
        route = path.split("?", 1)[0]
        if route == "/health":
            return self.record.health()
        if route == "/tables":
            return self.record.tables_doc()
        if route == "/backtrace":
            return self.record.backtrace_doc(params.get("thread"))
        return self._gone(route)

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        return self._gone(path)

    def request(
        self, method: str, path: str, body: dict | None = None, timeout: float | None = None, raw: bool = False
    ):
        if method == "GET" and body is None:
            return self.get(path, timeout)
        return self._gone(path)

    def snapshot(self, tables: dict, timeout: float) -> dict:
        return self.record.snapshot(tables)

    def _gone(self, route: str):
        raise EndpointError(
            f"{self.record.describe()}; its post-mortem record answers only read commands "
            f"(query, tables, describe, backtrace, status, doctor), not {route}."
        )


def find(pid: int) -> Record | None:
    """The record this host keeps for ``pid`` when that process is gone (else None)."""
    path = os.path.join(records_dir(create=False), str(int(pid)))
    meta = read_meta(path)
    if meta is not None:
        meta.update(path=path, local=True)
    else:
        meta = dump_only(int(pid))  # a fatal signal before the first snapshot
    if meta is None:
        return None
    meta = explain(meta)
    return Record(meta) if meta is not None else None


def job_records(job: str) -> list[Record]:
    """The newest record of every dead rank of ``job`` (this host's and the shared registry's)."""
    out: dict = {}
    for meta in list_records():  # newest first
        if meta.get("job") != job or meta.get("rank") is None or int(meta["rank"]) in out:
            continue
        meta = explain(meta)
        if meta is not None:
            out[int(meta["rank"])] = Record(meta)
    return [out[r] for r in sorted(out)]


def list_records() -> list[dict]:
    """Every record of this host (runtime directory) and of other hosts (shared registry), newest first.

    Each meta gets ``path`` (its folder) and ``local`` (whether it was written on this host).
    """
    here = socket.gethostname()
    out = []
    for base, shared in ((records_dir(create=False), False), (shared_records_dir(create=False), True)):
        try:
            names = os.listdir(base) if base else []
        except OSError:
            continue
        for name in names:
            if not (name.rpartition("-")[2] if shared else name).isdigit() or name.startswith("."):
                continue
            meta = read_meta(os.path.join(base, name))
            if meta is None or (shared and meta.get("host") in (None, here)):
                continue  # this host's own records are read from the runtime directory
            meta["path"] = os.path.join(base, name)
            meta["local"] = not shared
            out.append(meta)
    return sorted(out, key=lambda m: -float(m.get("time") or 0))


def _last_step(path: str):
    import numpy as np

    try:
        steps = load_tables(path).get("torch.steps/step")
        return int(np.nanmax(steps)) if steps is not None and len(steps) else None
    except (OSError, ValueError, KeyError, TypeError, OverflowError, MemoryError, EOFError, zipfile.BadZipFile):
        return None


def _where(frames: list) -> str:
    """`` in func (file:line)`` of the innermost frame of ``frames``, or ''."""
    if not frames:
        return ""
    f = frames[0]
    return f" in {f.get('func')} ({os.path.basename(str(f.get('file')))}:{f.get('lineno')})"


def explain(meta: dict) -> dict | None:
    """``meta`` with its cause made plain (``cause``, ``summary``, ``last_step``, ``fatal_dump``), or None
    when its process still runs, whatever the cause (a worker thread died; the snapshot of a live
    process; an exit record written while the interpreter shuts down): a live process is never dead.

    A ``snapshot`` (or ``thread_exception``) record whose process is gone means it was killed without
    warning, unless its fatal-signal dump (``fatal-<pid>.txt``) says a signal killed it.
    """
    pid = int(meta["pid"])
    if alive(meta):
        return None
    fatal = ""
    if meta.get("local", True):
        try:
            with open(os.path.join(runtime_dir(create=False), f"fatal-{pid}.txt"), errors="replace") as f:
                fatal = f.read().strip()
        except OSError:
            pass
    exc = meta.get("exception") or {}
    cause = meta["cause"]
    if fatal and cause in ("snapshot", "exit", "thread_exception"):
        meta["cause"] = "fatal_signal"
        meta["summary"] = fatal.splitlines()[0]
        meta["fatal_dump"] = fatal
    elif cause in ("snapshot", "thread_exception"):
        meta["cause"] = "killed"
        meta["summary"] = (
            "killed without warning, no exit was recorded (SIGKILL: the OOM killer, preemption, kill -9); "
            + (
                "its tables are from the last periodic snapshot"
                if cause == "snapshot"
                else "its tables are from when its worker thread died"
            )
        )
    elif cause == "terminated":
        main = next((t for t in meta.get("stacks") or () if t.get("is_main")), {})
        meta["summary"] = (
            f"terminated by {meta.get('detail') or 'SIGTERM'} (stopped from outside: torchrun, the "
            f"scheduler, kill); the main thread was{_where(main.get('frames')) or ' in an unknown frame'}"
        )
    elif exc:
        where = ""
        tb = exc.get("traceback") or ""
        lines = [line.strip() for line in tb.splitlines() if line.strip().startswith("File ")]
        if lines:
            where = " at " + lines[-1].replace("File ", "")
        what = (
            "interrupted (KeyboardInterrupt)" if cause == "interrupted" else f"{exc.get('type')}: {exc.get('message')}"
        )
        meta["summary"] = f"{what}{where}" + (f" (thread {meta['thread']})" if meta.get("thread") else "")
    elif cause == "interrupted":
        meta["summary"] = "interrupted (KeyboardInterrupt)"
    elif meta.get("exit_code") not in (None, 0):
        meta["summary"] = f"exited with code {meta['exit_code']} (sys.exit({meta.get('detail') or meta['exit_code']}))"
    else:
        meta["summary"] = "exited normally"
    deaths = meta.get("thread_deaths") or []
    if deaths:
        d = deaths[-1]
        meta["summary"] += f"; before that, thread {d['thread']} died of {d['type']}: {d['message']}"
    meta["last_step"] = _last_step(meta["path"]) if meta.get("path") else None
    return meta


def dump_only(pid: int) -> dict | None:
    """The meta of a process that died of a fatal signal before its first snapshot: its faulthandler
    dump alone (no tables), or None."""
    from probe.util.procfs import pid_alive

    path = os.path.join(runtime_dir(create=False), f"fatal-{pid}.txt")
    try:
        if pid_alive(pid) or os.path.getsize(path) == 0:
            return None
        when = os.path.getmtime(path)
    except OSError:
        return None
    return {
        "pid": pid,
        "cause": "snapshot",
        "time": when,
        "path": None,
        "tables": [],
        "local": True,
        "host": socket.gethostname(),
    }


def dead_records() -> list[dict]:
    """Records of processes that are gone (see ``explain``), newest first; a fatal-signal dump without a
    record (the process died before its first snapshot) counts as one, with no tables."""
    metas = list_records()
    recorded = {int(m["pid"]) for m in metas if m.get("local")}
    try:
        names = os.listdir(runtime_dir(create=False))
    except OSError:
        names = []
    for name in names:
        if name.startswith("fatal-") and name.endswith(".txt") and name[6:-4].isdigit():
            meta = None if int(name[6:-4]) in recorded else dump_only(int(name[6:-4]))
            if meta is not None:
                metas.append(meta)
    out = [explain(m) for m in sorted(metas, key=lambda m: -float(m.get("time") or 0))]
    return [m for m in out if m is not None]
