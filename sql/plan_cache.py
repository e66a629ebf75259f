"""Plans made before, kept in the runtime directory, so that the next ``probe doctor`` does not guard, qualify
and split its ~40 rules again: sqlglot takes 20-200 ms a rule, more than a second of the CLI's CPU in all,
which a host whose cores the training job keeps busy turns into several seconds of wall time.

A plan is a pure function of the SQL, the schema the ranks report, the client views' parameters and this
package's code, so its key is a hash of all four (the code by the size and mtime of every module here: an
edited guard or view invalidates every entry). The file is read only when it is a private file of this user
(``read_private``: never a symlink, never writable by others) and replaced atomically; a file that cannot be
read or parsed is an empty cache, never an error. It keeps the ``_KEEP`` most recent plans.

A front end that promises to write no files (the MCP read tier) keeps its plans in this process's memory
instead (``write=False``): it still reads the file the CLI wrote, and creates nothing, not even the runtime
directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from .federate import Plan

__all__ = ["PlanCache"]

_FILE = "doctor-plans.json"
_KEEP = 400
_LIMIT = 8 << 20  # bytes read at most
_MEMORY: dict = {}  # the plans of this process, for caches that write no file


def _code_stamp() -> str:
    here = Path(__file__).resolve().parent
    parts = []
    for p in sorted(here.glob("*.py")):
        try:
            st = p.stat()
            parts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            continue
    return ";".join(parts)


class PlanCache:
    """``get(sql)`` / ``put(sql, plan)`` for one schema and one set of view parameters; ``save()`` writes it back."""

    def __init__(self, schema: dict, params: dict, directory: str | None = None, *, write: bool = True):
        base = json.dumps([_code_stamp(), schema, params], sort_keys=True, default=str)
        self._base = hashlib.sha256(base.encode()).hexdigest()
        self._path = None
        self._plans: dict = {}
        self._dirty = False
        self._write = write
        try:
            if directory is None:
                from probe._runtime import runtime_dir

                directory = runtime_dir(create=write)
            self._path = os.path.join(directory, _FILE)
            from probe._runtime import read_private

            data = json.loads(read_private(self._path, _LIMIT))
            if isinstance(data, dict):
                self._plans = data
        except (OSError, ValueError, TypeError):  # none yet, not ours, or unreadable: start empty
            pass
        except Exception:  # no runtime directory here: the cache is off, never the doctor
            self._path = None
        if not write:
            self._plans.update(_MEMORY)

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

    def put(self, sql: str, plan: Plan) -> None:
        key = self._key(sql)
        self._plans.pop(key, None)  # most recent last
        self._plans[key] = {"outer": plan.outer, "parts": plan.parts, "views": plan.views}
        self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        keep = dict(list(self._plans.items())[-_KEEP:])
        if not self._write:
            _MEMORY.clear()
            _MEMORY.update(keep)
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
