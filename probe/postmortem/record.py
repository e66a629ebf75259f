"""Post-mortem records: what a process leaves in its runtime directory when it dies.

A record is a folder ``postmortem/<pid>/`` (mode 0700) holding two files anyone can
read without probe:

* ``meta.json``: who (pid, rank, host, argv, job), how it ended (``cause``: exception,
  thread_exception, exit, fatal_signal, snapshot), when, the exception and its
  traceback, and every thread's stack at that moment;
* ``tables.npz``: the tables, one array per column, named ``<table>/<column>``
  (``numpy.load`` reads it; text is stored as unicode arrays, never pickled), the last
  ``PROBE_POSTMORTEM_ROWS`` rows of each.

Writes are atomic (a temporary folder renamed into place), the folder and its files are
0700/0600, and at most ``PROBE_POSTMORTEM_KEEP`` records are kept: the oldest are removed
when a new one is written. A process killed with SIGKILL cannot write at death, so the
periodic snapshot (``snapshot.py``) writes the same record with cause ``snapshot``; a
record whose pid is gone and whose cause is still ``snapshot`` means the process was
killed without warning (the OOM killer, a scheduler's preemption, ``kill -9``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
import traceback

from .._config import setting
from .._runtime import runtime_dir
from ..util.errorlog import record_error

__all__ = ["write", "records_dir", "read_meta", "list_records", "dead_records", "TABLES"]

# The tables a record keeps: the rings (the last minutes of the run) and who/what the process was.
TABLES = ("torch.steps", "python.torch_trace", "probe.actions", "probe.errors", "process.info",
          "torch.optimizer", "torch.memory", "python.backtrace")

_write_lock = threading.Lock()
_thread_deaths: list = []  # worker threads that died of an exception: every later record keeps them


def records_dir(create: bool = True) -> str:
    path = os.path.join(runtime_dir(create=create), "postmortem")
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _stacks() -> list:
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        frames = [{"func": f.name, "file": f.filename, "lineno": f.lineno}
                  for f in reversed(traceback.extract_stack(frame))]
        out.append({"thread_id": ident, "name": names.get(ident), "is_main": ident == threading.main_thread().ident,
                    "frames": frames})
    return out


def _columns(name: str, rows: int) -> dict | None:
    """``{column: numpy array}`` of table ``name`` (its last ``rows`` rows), or None when absent."""
    import numpy as np

    from ..tables.registry import Context, get_table, to_columns

    tbl = get_table(name)
    if tbl is None:
        return None
    data = to_columns(tbl, tbl.generator(Context()))
    out = {}
    for col in tbl.columns:
        values = data[col.name]
        if not isinstance(values, np.ndarray):
            values = list(values)
        values = values[-rows:]
        if isinstance(values, np.ndarray) and values.dtype != object:
            out[col.name] = values
        elif col.type in ("BIGINT", "INTEGER", "DOUBLE", "TIMESTAMP"):
            out[col.name] = np.array([np.nan if v is None else float(v) for v in values], dtype="f8")
        elif col.type == "BOOLEAN":
            out[col.name] = np.array([bool(v) for v in values], dtype="b1")
        else:
            out[col.name] = np.array(["" if v is None else str(v) for v in values], dtype=str)
    return out


def _prune(keep: int) -> None:
    base = records_dir()
    entries = []
    for name in os.listdir(base):
        path = os.path.join(base, name)
        if name.isdigit() and os.path.isdir(path):
            entries.append((os.path.getmtime(path), path))
        elif name.startswith(".tmp-") and time.time() - os.path.getmtime(path) > 3600:
            shutil.rmtree(path, ignore_errors=True)  # a writer killed mid-write an hour ago
    for _, path in sorted(entries)[:-keep] if keep > 0 else sorted(entries):
        shutil.rmtree(path, ignore_errors=True)


def write(cause: str, exc: BaseException | None = None, *, thread: str | None = None, detail: str | None = None,
          tables=TABLES) -> str | None:
    """Write (or replace) this process's record; return its folder, or None when that failed.

    Never raises: a process dying must die of its own error, not of the probe's.
    """
    try:
        import numpy as np

        from ..agent import state

        with _write_lock:
            rows = setting("PROBE_POSTMORTEM_ROWS")
            base = records_dir()
            pid = os.getpid()
            tmp = os.path.join(base, f".tmp-{pid}-{threading.get_ident()}")
            shutil.rmtree(tmp, ignore_errors=True)
            os.mkdir(tmp, 0o700)
            arrays, written = {}, []
            for name in tables:
                try:
                    cols = _columns(name, rows)
                except Exception as err:  # one table failing must not lose the others
                    record_error(f"post-mortem table {name}", err)
                    continue
                if cols is None:
                    continue
                written.append(name)
                arrays.update({f"{name}/{c}": v for c, v in cols.items()})
            fd = os.open(os.path.join(tmp, "tables.npz"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            entry = state.info()
            entry.pop("token", None)
            if cause == "thread_exception" and exc is not None:
                _thread_deaths.append({"thread": thread, "type": type(exc).__name__, "message": str(exc)})
            meta = {
                "format": 1, "cause": cause, "time": time.time(), "pid": pid, "rank": entry.get("rank"),
                "world_size": entry.get("world_size"), "job": entry.get("job"), "host": socket.gethostname(),
                "argv": entry.get("argv") or list(sys.argv), "started_at": entry.get("started_at"),
                "thread": thread, "detail": detail, "tables": written, "thread_deaths": list(_thread_deaths),
                "exception": None if exc is None else {
                    "type": type(exc).__name__, "message": str(exc),
                    "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))},
                "stacks": _stacks(),
            }
            fd = os.open(os.path.join(tmp, "meta.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(meta, f, default=str)
            final = os.path.join(base, str(pid))
            old = final + f".old-{threading.get_ident()}"
            if os.path.isdir(final):
                os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            _prune(setting("PROBE_POSTMORTEM_KEEP"))
            return final
    except Exception as err:
        record_error("post-mortem record", err)
        return None


def read_meta(path: str) -> dict | None:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def list_records() -> list[dict]:
    """Every record in the runtime directory, newest first (the CLI's ``list --dead``)."""
    try:
        base = records_dir(create=False)
        names = os.listdir(base)
    except OSError:
        return []
    out = []
    for name in names:
        if not name.isdigit():
            continue
        meta = read_meta(os.path.join(base, name))
        if meta is not None:
            meta["path"] = os.path.join(base, name)
            out.append(meta)
    return sorted(out, key=lambda m: -float(m.get("time") or 0))


def _last_step(path: str):
    import numpy as np

    try:
        with np.load(os.path.join(path, "tables.npz")) as z:
            steps = z["torch.steps/step"] if "torch.steps/step" in z.files else None
            return int(steps.max()) if steps is not None and len(steps) else None
    except (OSError, ValueError, KeyError):
        return None


def dead_records() -> list[dict]:
    """Records of processes that are gone, each with its cause made plain and a one-line summary.

    A ``snapshot`` record whose process is gone means it was killed without warning,
    unless its fatal-signal dump (``fatal-<pid>.txt``) says a signal killed it.
    """
    from .._runtime import pid_alive

    metas = list_records()
    recorded = {int(m["pid"]) for m in metas}
    try:  # a fatal signal in a process that never got to write a record: its faulthandler dump alone
        names = os.listdir(runtime_dir(create=False))
    except OSError:
        names = []
    for name in names:
        if name.startswith("fatal-") and name.endswith(".txt") and name[6:-4].isdigit():
            pid = int(name[6:-4])
            path = os.path.join(runtime_dir(create=False), name)
            if pid not in recorded and not pid_alive(pid) and os.path.getsize(path) > 0:
                metas.append({"pid": pid, "cause": "snapshot", "time": os.path.getmtime(path), "path": None,
                              "tables": []})
    out = []
    for meta in sorted(metas, key=lambda m: -float(m.get("time") or 0)):
        pid = int(meta["pid"])
        if meta["cause"] == "snapshot" and pid_alive(pid):
            continue  # the periodic snapshot of a live process
        fatal = ""
        try:
            with open(os.path.join(runtime_dir(create=False), f"fatal-{pid}.txt"), errors="replace") as f:
                fatal = f.read().strip()
        except OSError:
            pass
        exc = meta.get("exception") or {}
        if fatal and meta["cause"] in ("snapshot", "exit"):
            meta["cause"] = "fatal_signal"
            meta["summary"] = fatal.splitlines()[0]
            meta["fatal_dump"] = fatal
        elif meta["cause"] == "snapshot":
            meta["cause"] = "killed"
            meta["summary"] = ("no exit was recorded: killed without warning (SIGKILL, the OOM killer, preemption); "
                               "the tables are from the last periodic snapshot")
        elif exc:
            where = ""
            tb = exc.get("traceback") or ""
            lines = [l.strip() for l in tb.splitlines() if l.strip().startswith("File ")]
            if lines:
                where = " at " + lines[-1].replace("File ", "")
            meta["summary"] = f"{exc.get('type')}: {exc.get('message')}{where}" + (
                f" (thread {meta['thread']})" if meta.get("thread") else "")
        elif meta["cause"] == "interrupted":
            meta["summary"] = "interrupted (KeyboardInterrupt)"
        else:
            meta["summary"] = "exited normally"
        deaths = meta.get("thread_deaths") or []
        if deaths and meta["cause"] != "thread_exception":
            d = deaths[-1]
            meta["summary"] += f"; before that, thread {d['thread']} died of {d['type']}: {d['message']}"
        meta["last_step"] = _last_step(meta["path"]) if meta.get("path") else None
        out.append(meta)
    return out
