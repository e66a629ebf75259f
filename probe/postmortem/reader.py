"""Reading a post-mortem record back as the tables a live process would hand over.

The CLI turns a dead pid (or a dead rank of a job) into a target whose answers come
from here instead of from a server: ``tables_doc`` is its ``GET /tables``, ``snapshot``
its ``POST /snapshot`` (the same decoded form as ``probe.util.wire.decode``, so the
query runs through the one path: DuckDB in the CLI over per-rank snapshots), and
``backtrace_doc`` its ``GET /backtrace``. Needs numpy only, like the wire format. Here too:
listing the records of this host and of the shared registry (``list_records``), and saying
how each process ended (``explain``, ``dead_records``: what ``probe list --dead`` shows).

What a reader restores: the declared SQL types (``meta.json``'s ``schema``) and NULLs
(``<column>.valid`` arrays; integer and timestamp columns stored as NaN in older
records). ``process.info`` says where its row comes from: ``source`` is
``postmortem``, ``state`` is ``dead``, and ``exit_cause``/``exited_at``/``exit_reason``
say how and when the process ended.
"""

from __future__ import annotations

import os
import socket
import zipfile

from .._runtime import runtime_dir
from .record import load_tables, records_dir, shared_records_dir
from .retention import alive, read_meta

__all__ = ["Record", "find", "job_records", "list_records", "dead_records", "dump_only", "explain"]

_NUMERIC = ("BIGINT", "INTEGER", "SMALLINT", "TINYINT", "UBIGINT", "UINTEGER", "HUGEINT")
_BACKTRACE = {
    "thread_id": "BIGINT",
    "thread_name": "VARCHAR",
    "is_main": "BOOLEAN",
    "depth": "INTEGER",
    "func": "VARCHAR",
    "file": "VARCHAR",
    "lineno": "INTEGER",
    "line": "VARCHAR",
    "is_native": "BOOLEAN",
}
_PROCESS_OVERLAY = {"source": "VARCHAR", "exit_cause": "VARCHAR", "exited_at": "TIMESTAMP", "exit_reason": "VARCHAR"}


def find(pid: int) -> "Record | None":
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


def job_records(job: str) -> list["Record"]:
    """The newest record of every dead rank of ``job`` (this host's and the shared registry's)."""
    out: dict = {}
    for meta in list_records():  # newest first
        if meta.get("job") != job or meta.get("rank") is None or int(meta["rank"]) in out:
            continue
        meta = explain(meta)
        if meta is not None:
            out[int(meta["rank"])] = Record(meta)
    return [out[r] for r in sorted(out)]


def parse_fatal_dump(text: str) -> list:
    """faulthandler's dump as stacks (``[{thread_id, current, frames}]``, frames innermost first).

    >>> parse_fatal_dump('Fatal Python error: Segmentation fault\\n\\n'
    ...                  'Current thread 0x00007f01 (most recent call first):\\n'
    ...                  '  File "/x/t.py", line 3 in boom\\n  File "/x/t.py", line 9 in <module>\\n')[0]["frames"][0]
    {'func': 'boom', 'file': '/x/t.py', 'lineno': 3, 'line': None}
    """
    import re

    out: list = []
    for line in text.splitlines():
        head = re.match(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)", line)
        if head:
            out.append(
                {"thread_id": int(head.group(2), 16), "current": head.group(1) == "Current thread", "frames": []}
            )
            continue
        frame = re.match(r'^\s+File "(.*)", line (\d+) in (.*)$', line)
        if frame and out:
            out[-1]["frames"].append(
                {"func": frame.group(3), "file": frame.group(1), "lineno": int(frame.group(2)), "line": None}
            )
    return out


def _type_of(array) -> str:
    """A declared type for a column of an older record without a schema."""
    kind = array.dtype.kind
    return {"f": "DOUBLE", "i": "BIGINT", "u": "BIGINT", "b": "BOOLEAN"}.get(kind, "VARCHAR")


def _column(array, valid, typ: str, n: int) -> dict:
    """One column in ``wire.decode``'s form (``type``, ``kind``, ``data``, ``valid``) with its NULLs restored."""
    import numpy as np

    if array is None:  # a column the record does not have: NULL in every row
        if typ == "VARCHAR":
            return {"type": typ, "kind": "str", "data": np.full(n, None, dtype=object), "valid": None}
        return {"type": typ, "kind": "f8", "data": np.zeros(n, dtype="<f8"), "valid": np.zeros(n, dtype=bool)}
    kind = array.dtype.kind
    if kind in "USO":
        data = np.empty(len(array), dtype=object)
        data[:] = array.tolist()
        if valid is not None:
            data[~valid] = None
        return {"type": typ, "kind": "str", "data": data, "valid": None}
    if kind == "b":
        return {"type": typ, "kind": "b1", "data": array.astype(bool), "valid": valid}
    if kind in "iu":
        return {"type": typ, "kind": "i8", "data": array.astype("<i8"), "valid": valid}
    data = array.astype("<f8")
    if typ in _NUMERIC or typ == "TIMESTAMP" or typ == "BOOLEAN":  # NaN can only mean NULL there
        nan = np.isnan(data)
        if nan.any():
            valid = ~nan if valid is None else (valid & ~nan)
            data = np.where(nan, 0.0, data)
        if typ != "TIMESTAMP":
            return {
                "type": typ,
                "kind": "b1" if typ == "BOOLEAN" else "i8",
                "data": data != 0 if typ == "BOOLEAN" else data.astype("<i8"),
                "valid": valid,
            }
    return {"type": typ, "kind": "f8", "data": data, "valid": valid}


class Record:
    """One dead process's record: its meta (``explain``'d) and, on demand, its tables."""

    def __init__(self, meta: dict):
        self.meta = meta
        self.pid = int(meta["pid"])
        self.rank = meta.get("rank")
        self.stored = [t for t in meta.get("tables") or () if meta.get("path")]
        if meta.get("fatal_dump") and "python.backtrace" not in self.stored:
            self.stored.append("python.backtrace")  # a crash before the first snapshot: the dump's stacks alone
        self._arrays: dict | None = None

    @property
    def entry(self) -> dict:
        """A registry-like entry for the CLI's Target (``postmortem``: the record's folder)."""
        m = self.meta
        return {
            "pid": self.pid,
            "rank": self.rank,
            "world_size": m.get("world_size"),
            "job": m.get("job"),
            "host": m.get("host"),
            "argv": m.get("argv"),
            "started_at": m.get("started_at"),
            "postmortem": m.get("path"),
            "cause": m.get("cause"),
            "summary": m.get("summary"),
            "last_step": m.get("last_step"),
            "died_at": m.get("time"),
        }

    def describe(self) -> str:
        """A clause naming the process and how it ended, e.g. ``pid 41 died (exception: RuntimeError: ...)``."""
        who = f"pid {self.pid}" + (f" (rank {self.rank})" if self.rank is not None else "")
        summary = str(self.meta.get("summary") or "")
        return f"{who} is gone ({self.meta['cause']}: {summary[:157] + '...' if len(summary) > 160 else summary})"

    def _declared(self, table: str) -> list:
        decl = (self.meta.get("schema") or {}).get(table)
        cols = [(c[0], c[1]) for c in decl["columns"]] if decl else []
        if not cols and table in self.stored:
            arrays = self.arrays()
            prefix = table + "/"
            cols = [
                (k[len(prefix) :], _type_of(arrays[k]))
                for k in arrays
                if k.startswith(prefix) and not k.endswith(".valid")
            ]
        if not cols and table == "python.backtrace":
            cols = list(_BACKTRACE.items())
        if table == "process.info":
            cols += [(c, t) for c, t in _PROCESS_OVERLAY.items() if c not in dict(cols)]
        return cols

    def arrays(self) -> dict:
        """``{"<table>/<column>": numpy array}`` from tables.npz (read once; text never unpickled)."""
        if self._arrays is None:
            self._arrays = {}
            if self.meta.get("path"):
                try:  # bounded before anything is decompressed: a crafted record cannot bloat the CLI
                    self._arrays = load_tables(self.meta["path"])
                except (OSError, ValueError, TypeError, OverflowError, MemoryError, EOFError, zipfile.BadZipFile):
                    self._arrays = {}
        return self._arrays

    def tables_doc(self) -> dict:
        """What ``GET /tables`` answers: the tables this record keeps, with their declarations."""
        schema = self.meta.get("schema") or {}
        out = []
        for name in self.stored:
            decl = schema.get(name) or {}
            desc = {c[0]: c[2] for c in decl.get("columns", []) if len(c) > 2}
            out.append(
                {
                    "name": name,
                    "kind": "postmortem",
                    "description": decl.get("description") or f"{name} as the dead process left it.",
                    "examples": decl.get("examples") or [],
                    "columns": [
                        {"name": c, "type": t, "description": desc.get(c, "")} for c, t in self._declared(name)
                    ],
                }
            )
        return {"tables": out}

    def _process_info(self, cols: dict, n: int) -> dict:
        import numpy as np

        m = self.meta
        fill = {"source": "postmortem", "state": "dead", "exit_cause": m.get("cause"), "exit_reason": m.get("summary")}
        for name, value in fill.items():
            if name in cols:
                data = np.empty(n, dtype=object)
                data[:] = value
                cols[name] = {"type": "VARCHAR", "kind": "str", "data": data, "valid": None}
        if "exited_at" in cols:
            cols["exited_at"] = {
                "type": "TIMESTAMP",
                "kind": "f8",
                "data": np.full(n, float(m.get("time") or 0.0)),
                "valid": None,
            }
        return cols

    def snapshot(self, requests: dict) -> dict:
        """``requests`` (``{table: {"columns": [...], "filter": ...}}``) answered from the record in
        ``wire.decode``'s form. A table the record does not keep has no rows (its declared columns);
        pushed-down filters are not applied here (the client's query applies them again)."""
        arrays = self.arrays()
        tables = {}
        for name, spec in requests.items():
            declared = dict(self._declared(name))
            wanted = list(spec.get("columns") or declared)
            n = 0
            if name in self.stored:
                first = next((arrays[k] for k in arrays if k.startswith(name + "/") and not k.endswith(".valid")), None)
                n = 0 if first is None else len(first)
            cols = {}
            for c in wanted:
                key = f"{name}/{c}"
                array = arrays.get(key) if name in self.stored else None
                typ = declared.get(c) or (_type_of(array) if array is not None else "VARCHAR")
                cols[c] = _column(array, arrays.get(key + ".valid") if array is not None else None, typ, n)
            if name == "process.info":
                cols = self._process_info(cols, n)
            elif name == "python.backtrace" and self.meta.get("fatal_dump"):
                data = self._backtrace_columns()
                n = len(data["depth"])
                cols = {
                    c: _column(data.get(c), None, typ, n) if c in data else _column(None, None, typ, n)
                    for c, typ in ((c, declared.get(c, "VARCHAR")) for c in wanted)
                }
            tables[name] = {"rows": n, "columns": cols}
        m = self.meta
        return {
            "meta": {
                "pid": self.pid,
                "rank": self.rank,
                "host": m.get("host"),
                "source": "postmortem",
                "cause": m.get("cause"),
                "died_at": m.get("time"),
            },
            "tables": tables,
        }

    def stacks(self) -> list:
        """Every thread's stack at death: faulthandler's dump after a fatal signal (thread names and the
        main thread from the last snapshot's stacks), else meta.json's stacks."""
        known = {t.get("thread_id"): t for t in self.meta.get("stacks") or ()}
        if self.meta.get("fatal_dump"):
            dumped = parse_fatal_dump(self.meta["fatal_dump"])
            if dumped:
                out = []
                for t in dumped:
                    k = known.get(t["thread_id"], {})
                    # without a snapshot's stacks, the thread whose outermost frame is a module's body is the main one
                    main = k.get("is_main") if k else bool(t["frames"]) and t["frames"][-1]["func"] == "<module>"
                    out.append(
                        {
                            "thread_id": t["thread_id"],
                            "name": k.get("name"),
                            "is_main": bool(main),
                            "daemon": k.get("daemon"),
                            "frames": t["frames"],
                            "crashed": t["current"],
                        }
                    )
                return sorted(out, key=lambda t: not t["is_main"])
        return list(known.values())

    def _backtrace_columns(self) -> dict:
        """python.backtrace from ``stacks()`` (after a fatal signal the snapshot's table is older than the crash)."""
        import numpy as np

        keys = {k: "str" if t == "VARCHAR" else "b1" if t == "BOOLEAN" else "i8" for k, t in _BACKTRACE.items()}
        rows = [
            (
                t.get("thread_id"),
                t.get("name"),
                bool(t.get("is_main")),
                d,
                f.get("func"),
                f.get("file"),
                f.get("lineno"),
                f.get("line"),
                False,
            )
            for t in self.stacks()
            for d, f in enumerate(t.get("frames") or ())
        ]
        out = {}
        for i, (k, kind) in enumerate(keys.items()):
            values = [r[i] for r in rows]
            if kind == "str":
                data = np.empty(len(values), dtype=object)
                data[:] = values
            else:
                data = np.array(values, dtype="<i8" if kind == "i8" else bool)
            out[k] = data
        return out

    def backtrace_doc(self, thread: str | None = None) -> dict:
        """What ``GET /backtrace`` answers: the stacks at death (the exception's traceback for the thread
        that raised it; faulthandler's dump after a fatal signal)."""
        import time

        m = self.meta
        threads = []
        for t in self.stacks():
            if thread not in (None, "") and thread not in (t.get("name"), str(t.get("thread_id"))):
                continue
            threads.append(
                {
                    "thread_id": t.get("thread_id"),
                    "native_id": None,
                    "name": t.get("name"),
                    "is_main": t.get("is_main"),
                    "daemon": t.get("daemon"),
                    "frames": [dict(f, depth=i) for i, f in enumerate(t.get("frames") or ())],
                }
            )
        if thread not in (None, "") and not threads:
            from .._errors import QueryError

            names = ", ".join(sorted({str(t.get("name")) for t in self.stacks()}))
            raise QueryError(
                f"the record of pid {self.pid} has no thread named or numbered {thread!r}; threads: {names}."
            )
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(m.get("time") or 0)))
        what = {
            "killed": "the stacks of its last periodic snapshot",
            "fatal_signal": "faulthandler's dump at the crash",
            "terminated": "the stacks when the signal arrived",
        }
        note = (
            f"[post-mortem record: pid {self.pid} is gone ({m['cause']}, {when}): {m.get('summary')}; "
            f"{what.get(m['cause'], 'the stacks when it died')}]"
        )
        doc = {
            "source": "postmortem",
            "pid": self.pid,
            "rank": self.rank,
            "threads": threads,
            "note": note,
            "cause": m.get("cause"),
            "exception": m.get("exception"),
        }
        if m.get("fatal_dump"):
            doc["fatal_dump"] = m["fatal_dump"]
            doc["note"] += "\n" + m["fatal_dump"].splitlines()[0]
        return doc

    def health(self) -> dict:
        """What ``GET /health`` answers for a dead process."""
        m = self.meta
        return {
            "ok": True,
            "pid": self.pid,
            "rank": self.rank,
            "state": "dead",
            "source": "postmortem",
            "step": m.get("last_step"),
            "cause": m.get("cause"),
            "summary": m.get("summary"),
            "died_at": m.get("time"),
        }


# -- listing: the records of this host and of other hosts, and how each process ended -------------------


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
    from .._runtime import pid_alive

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
