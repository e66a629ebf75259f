"""Errors caught inside the probe, kept so a user can see them (``probe.errors``).

A hook or a request handler never raises into the training loop: it calls
``record_error`` and goes on.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback


_CAPACITY = 1000
_rows: list[tuple] = []
_lock = threading.Lock()
_total = 0


def record_error(source: str, exc: BaseException | None = None) -> None:
    """Remember an error raised inside the probe; never raises itself."""
    global _total
    try:
        if exc is None:
            exc = sys.exc_info()[1]
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=8)) if exc else ""
        row = (
            time.time(),
            source,
            type(exc).__name__ if exc else "",
            str(exc) if exc else "",
            tb,
            threading.current_thread().name,
        )
        with _lock:
            _total += 1
            _rows.append(row)
            if len(_rows) > _CAPACITY:
                del _rows[: len(_rows) - _CAPACITY]
    except Exception:  # pragma: no cover - the last line of defence
        pass


def error_rows() -> list[tuple]:
    with _lock:
        return list(_rows)


def error_count() -> int:
    return _total
