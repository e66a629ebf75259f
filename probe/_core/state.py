"""What this process's probe is: its registry entry and the status fields others add.

A leaf module: it imports nothing of the probe but the error log, so every room (tables,
training hooks, actions, routes, watchdog) may read the entry and register status
providers without importing the server's start-up code.
"""

from __future__ import annotations

import time
from typing import Callable

from ..util.errorlog import record_error


_entry: dict = {}
_status_providers: list[Callable[[], dict]] = []


def info() -> dict:
    """The registry entry of this process (a copy), or {} when the probe is not running."""
    return dict(_entry)


def set_entry(entry: dict) -> None:
    _entry.clear()
    _entry.update(entry)


def clear() -> None:
    """Forget the entry and every status provider (the probe stopped; a new start adds its own)."""
    _entry.clear()
    _status_providers.clear()


def add_status_provider(fn: Callable[[], dict]) -> None:
    """Add fields to ``/health`` and ``probe list`` (e.g. the step counter); never raises into callers."""
    if fn not in _status_providers:
        _status_providers.append(fn)


def status() -> dict:
    out = info()
    out.pop("key", None)
    out["uptime_s"] = time.time() - out.get("started_at", time.time())
    for fn in list(_status_providers):
        try:
            out.update(fn() or {})
        except Exception as exc:
            record_error("status provider", exc)
    return out
