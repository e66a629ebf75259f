"""Reading a post-mortem record back as the tables a live process would hand over.

The CLI turns a dead pid (or a dead rank of a job) into a target whose answers come
from here instead of from a server: ``tables_doc`` is its ``GET /tables``, ``snapshot``
its ``POST /snapshot`` (the same decoded form as ``probe.util.wire.decode``, so the
query runs through the one path: DuckDB in the CLI over per-rank snapshots), and
``backtrace_doc`` its ``GET /backtrace``. Needs numpy only, like the wire format. Listing the
records and saying how each process ended is ``postmortem``'s.

What a reader restores: the declared SQL types (``meta.json``'s ``schema``) and NULLs
(``<column>.valid`` arrays; integer and timestamp columns stored as NaN in older
records). ``process.info`` says where its row comes from: ``source`` is
``postmortem``, ``state`` is ``dead``, and ``exit_cause``/``exited_at``/``exit_reason``
say how and when the process ended.
"""

from __future__ import annotations

import zipfile

from probe.postmortem.record import backtrace_columns, load_tables


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
    """One column in ``wire.decode``'s form (``type``, ``kind``, ``data``, ``valid``) with its NULLs restored.

    Only valid cells are cast to an integer type: whatever lies under a NULL (an older record kept a ring's
    unwritten slots) is never read as a number.

    >>> import numpy as np, warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("error")  # numpy's "invalid value encountered in cast" would raise here
    ...     c = _column(np.array([7.0, 3.6e174, np.nan]), np.array([True, False, True]), "BIGINT", 3)
    >>> c["data"].tolist(), c["valid"].tolist()
    ([7, 0, 0], [True, False, False])
    """
    import numpy as np

    if array is None:  # a column the record does not have: NULL in every row
        if typ == "VARCHAR":
            return {"type": typ, "kind": "str", "data": np.full(n, None, dtype=object), "valid": None}
        return {"type": typ, "kind": "f8", "data": np.zeros(n, dtype="<f8"), "valid": np.zeros(n, dtype=bool)}
    kind = array.dtype.kind
    if valid is not None and (valid.dtype.kind != "b" or valid.shape != array.shape):
        valid = None  # not a mask of this column (a damaged record): its values as they are
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
    if typ in _NUMERIC or typ == "TIMESTAMP" or typ == "BOOLEAN":  # NaN, infinity, past int64: NULL there
        fits = np.abs(data) < 2.0**63
        bad = ~fits if valid is None else ~(valid & fits)
        if bad.any():
            valid = ~bad
            data = np.where(bad, 0.0, data)
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
        kept = {k: m.get(k) for k in ("world_size", "job", "host", "argv", "started_at", "cause", "summary")}
        return dict(
            kept,
            pid=self.pid,
            rank=self.rank,
            postmortem=m.get("path"),
            last_step=m.get("last_step"),
            died_at=m.get("time"),
        )

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
                cols = {c: _column(data.get(c), None, declared.get(c, "VARCHAR"), n) for c in wanted}
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

        data = backtrace_columns(self.stacks())
        out = {}
        for k, typ in _BACKTRACE.items():
            if typ == "VARCHAR":
                out[k] = np.empty(len(data[k]), dtype=object)
                out[k][:] = data[k]
            else:
                out[k] = np.array(data[k], dtype=bool if typ == "BOOLEAN" else "<i8")
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
            from probe._errors import QueryError

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
