"""Plans made before, so that the same query over the same tables is guarded, qualified and split once: sqlglot
takes 20-200 ms a query, and ``probe doctor`` runs ~40 rules, more than a second of the CLI's CPU in all, which
a host whose cores the training job keeps busy turns into several seconds of wall time.

A plan is a pure function of the SQL, the schema the ranks report, the client views' parameters and this
package's code, so its key is a hash of all four (the code by the size and mtime of every module here: an
edited guard or view invalidates every entry). Where the plans are kept is the ``store``:

- ``"file"``: a file in the runtime directory, for the CLI's doctor, whose next run is another process. The
  file is read only when it is a private file of this user (``read_private``: never a symlink, never writable
  by others) and replaced atomically; a file that cannot be read or parsed is an empty cache, never an error.
- ``"read"``: that file is read, new plans are kept in this process's memory only, and nothing is created, not
  even the runtime directory (a front end that promises to write no files: the MCP read tier).
- ``"memory"``: this process's memory only (a client repeating a query: the web page's panels, a watch loop).

Each store keeps the ``_KEEP`` most recent plans.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

from .federate import Plan


_FILE = "doctor-plans.json"
_KEEP = 400
_LIMIT = 8 << 20  # bytes read at most
_MEMORY: dict = {}  # the plans of this process, for the stores that write no file
_MEMORY_LOCK = threading.Lock()  # a client's threads (the web page's panels) plan at once
_STORES = ("file", "read", "memory")
_STAMP: list = []  # the code stamp, taken once: this process's modules do not change under it


def _code_stamp() -> str:
    if _STAMP:
        return _STAMP[0]
    here = Path(__file__).resolve().parent
    parts = []
    for p in sorted(here.glob("*.py")):
        try:
            st = p.stat()
            parts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            continue
    _STAMP.append(";".join(parts))
    return _STAMP[0]


class PlanCache:
    """``plan(sql)`` (or ``get``/``put``) for one schema and one set of view parameters; ``save()`` keeps the new
    plans in the ``store``."""

    def __init__(self, schema: dict, params: dict, directory: str | None = None, *, store: str = "file"):
        if store not in _STORES:
            raise ValueError(f"store must be one of {', '.join(_STORES)}, not {store!r}")
        base = json.dumps([_code_stamp(), schema, params], sort_keys=True, default=str)
        self._base = hashlib.sha256(base.encode()).hexdigest()
        self._path = None
        self._plans: dict = {}
        self._dirty = False
        self._store = store
        self._schema, self._params = schema, params
        if store != "memory":
            self._read(directory)
        if store != "file":
            with _MEMORY_LOCK:
                self._plans.update(_MEMORY)

    def _read(self, directory: str | None) -> None:
        try:
            if directory is None:
                from probe._runtime import runtime_dir

                directory = runtime_dir(create=self._store == "file")
            self._path = os.path.join(directory, _FILE)
            from probe._runtime import read_private

            data = json.loads(read_private(self._path, _LIMIT))
            if isinstance(data, dict):
                self._plans = data
        except (OSError, ValueError, TypeError):  # none yet, not ours, or unreadable: start empty
            pass
        except Exception:  # no runtime directory here: the file is off, never the query
            self._path = None

    def _key(self, sql: str) -> str:
        return hashlib.sha256(f"{self._base}\n{sql}".encode()).hexdigest()

    def get(self, sql: str) -> Plan | None:
        entry = self._plans.get(self._key(sql))
        if not isinstance(entry, dict):
            return None
        try:
            return Plan(outer=str(entry["outer"]), parts=dict(entry["parts"]), views=dict(entry["views"]))
        except (KeyError, TypeError, ValueError):
            return None

    def plan(self, sql: str) -> Plan:
        """The plan of ``sql``: the one kept, else a new one (kept; raises what ``federate.plan`` raises)."""
        found = self.get(sql)
        if found is None:
            from .federate import plan

            found = plan(sql, self._schema, self._params)
            self.put(sql, found)
        return found

    def requests(self, parts: dict) -> dict:
        """What every rank must snapshot for ``parts`` (a plan's per-rank SQL, or the doctor's parts of all its rules):
        ``pushdown.snapshot_requests``, kept like a plan."""
        key = self._key("\0requests\n" + json.dumps(parts, sort_keys=True))
        entry = self._plans.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("requests"), dict):
            return entry["requests"]
        from .pushdown import snapshot_requests

        found = snapshot_requests(parts, self._schema)
        self._plans.pop(key, None)
        self._plans[key] = {"requests": found}
        self._dirty = True
        return found

    def put(self, sql: str, plan: Plan) -> None:
        key = self._key(sql)
        self._plans.pop(key, None)  # most recent last
        self._plans[key] = {"outer": plan.outer, "parts": plan.parts, "views": plan.views}
        self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        keep = dict(list(self._plans.items())[-_KEEP:])
        if self._store != "file":
            with _MEMORY_LOCK:
                _MEMORY.update(keep)
                for key in list(_MEMORY)[: max(0, len(_MEMORY) - _KEEP)]:
                    del _MEMORY[key]
            self._dirty = False
            return
        if self._path is None:
            return
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{_FILE}.", suffix=".tmp", dir=os.path.dirname(self._path))
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(keep, f)
                os.replace(tmp, self._path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            pass
        self._dirty = False


def forget() -> None:
    """Drop the plans this process keeps in memory."""
    with _MEMORY_LOCK:
        _MEMORY.clear()
