"""Which records stay: whether a record's process still runs, and the keep policy.

A record answers for a process only once that process is gone, whatever its cause (a worker thread's death or
an ``exit`` record written while the interpreter shuts down leaves a process that still runs). A pid can be
reused, so a record keeps its process's start time (``proc_start``) and a live pid counts as the record's
process only when its start time matches.

``prune`` keeps at most ``PROBE_POSTMORTEM_KEEP`` records in a folder, in the order of eviction that
docs/postmortem.md gives (clean exits of gone processes first, records of running ones last); faulthandler's
``fatal-<pid>.txt`` files go with their pid's record, and one without a record counts as a record of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time


MAX_META_BYTES = 16 << 20  # a record's meta.json (stacks, schema, exception): far more than a real one holds

# The fields readers rely on and the types they may have (None always allowed except for pid and cause).
_META_TYPES = {
    "pid": int,
    "cause": str,
    "rank": int,
    "world_size": int,
    "host": str,
    "job": str,
    "time": (int, float),
    "started_at": (int, float),
    "proc_start": int,
    "exit_code": int,
    "thread": str,
    "detail": str,
    "summary": str,
    "fatal_dump": str,
    "tables": list,
    "schema": dict,
    "thread_deaths": list,
    "exception": dict,
    "stacks": list,
    "argv": list,
}


def valid_meta(meta) -> bool:
    """Whether a record's meta has the types its readers rely on (a crafted one is skipped, never crashed on).

    >>> valid_meta({"pid": 7, "cause": "exit", "rank": "0"})
    False
    >>> valid_meta({"pid": 7, "cause": "exit", "time": 1.7e9, "tables": ["torch.steps"]})
    True
    >>> valid_meta({"pid": 7, "cause": "exit", "time": 1.7e9, "thread_deaths": [{}]})
    False
    """
    if not isinstance(meta, dict) or type(meta.get("pid")) is not int or meta["pid"] <= 0:
        return False
    if not isinstance(meta.get("cause"), str):
        return False
    when = meta.get("time")
    if type(when) not in (int, float) or not 0 <= when < 1e11:  # seconds since 1970: a date time.localtime takes
        return False
    for key, kind in _META_TYPES.items():
        value = meta.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            return False
    if not all(isinstance(t, str) for t in meta.get("tables") or ()):
        return False
    if not all(
        isinstance(d, dict) and {"thread", "type", "message"} <= d.keys() for d in meta.get("thread_deaths") or ()
    ):
        return False
    for stack in meta.get("stacks") or ():
        if not isinstance(stack, dict) or not isinstance(stack.get("frames") or [], list):
            return False
        if not all(isinstance(f, dict) for f in stack.get("frames") or ()):
            return False
    tb = (meta.get("exception") or {}).get("traceback")
    return tb is None or isinstance(tb, str)


def read_meta(path: str) -> dict | None:
    """A record's meta.json when it is a private file of this user (never a symlink) of sane size and types."""
    from .._runtime import read_private

    try:
        meta = json.loads(read_private(os.path.join(path, "meta.json"), MAX_META_BYTES))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    return meta if valid_meta(meta) else None


def alive(meta: dict) -> bool:
    """Whether the record's own process still runs (not merely its pid).

    This host: the kernel says the pid runs (a zombie does not) and, when the record has
    its start time, the running process started then. Another host (the shared registry):
    that host's registry entry for the pid is there, from the same start (``started_at``).
    """
    from .._runtime import process_is

    pid = int(meta["pid"])
    if meta.get("local", True):
        return process_is(pid, meta.get("proc_start"))
    from .._runtime import read_private, shared_registry

    base = shared_registry(create=False)
    if not base:
        return False
    try:
        entry = json.loads(read_private(os.path.join(base, f"{meta.get('host')}-{pid}.json")))
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    ours, theirs = meta.get("started_at"), entry.get("started_at") if isinstance(entry, dict) else None
    if type(theirs) not in (int, float):
        theirs = None
    return ours is None or theirs is None or abs(float(ours) - float(theirs)) < 1e-3


def is_clean_exit(meta: dict) -> bool:
    """A normal exit (code 0 or unknown) with no thread death: the first record to evict."""
    return meta.get("cause") == "exit" and meta.get("exit_code") in (None, 0) and not meta.get("thread_deaths")


def _fatal_files(folder: str) -> dict:
    """``{pid: path}`` of the ``fatal-<pid>.txt`` files in ``folder``."""
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    return {
        int(n[6:-4]): os.path.join(folder, n)
        for n in names
        if n.startswith("fatal-") and n.endswith(".txt") and n[6:-4].isdigit()
    }


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def prune(base: str, keep: int, prefix: str = "", fatal_dir: str | None = None) -> None:
    """Keep at most ``keep`` records in ``base`` (folders named ``<prefix><pid>``) by the module's policy;
    with ``fatal_dir`` (this host's runtime directory), bound its ``fatal-<pid>.txt`` files with them."""
    from ..util.procfs import pid_alive

    me = os.getpid()
    entries, recorded = [], {}
    for name in os.listdir(base):
        path = os.path.join(base, name)
        try:
            if name.startswith(prefix) and name[len(prefix) :].isdigit() and os.path.isdir(path):
                pid = int(name[len(prefix) :])
                meta = read_meta(path) or {"pid": pid}
                meta.setdefault("pid", pid)
                order = 2 if pid == me or alive(meta) else 0 if is_clean_exit(meta) else 1
                entries.append((order, os.path.getmtime(path), path, pid))
                recorded[pid] = path
            elif name.startswith(".tmp-") and time.time() - os.path.getmtime(path) > 3600:
                shutil.rmtree(path, ignore_errors=True)  # a writer killed mid-write an hour ago
        except OSError:
            continue  # removed under us by another writer
    fatal = _fatal_files(fatal_dir) if fatal_dir else {}
    for pid, path in fatal.items():
        if pid == me or pid_alive(pid):
            continue
        try:
            if os.path.getsize(path) == 0:
                _remove(path)  # SIGKILL or os._exit: faulthandler had nothing to say
            elif pid not in recorded:
                entries.append((1, os.path.getmtime(path), path, pid))  # a crash before the first snapshot
        except OSError:
            continue
    for _, _, path, pid in sorted(entries)[:-keep] if keep > 0 else sorted(entries):
        _remove(path)
        if path == recorded.get(pid) and pid in fatal:
            _remove(fatal[pid])
