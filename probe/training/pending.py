"""Device values copied off the device without blocking (a pinned host copy and an event, ``Capture.hold``):
read into their rows of a ring once the copy has landed, never by waiting for the device."""

from __future__ import annotations

import threading

from ..util.errorlog import record_error

__all__ = ["Pending", "read"]


def read(holder):
    """The value behind a holder from ``Capture.hold``, or None while its device copy has not landed."""
    host, ev = holder
    if ev is not None and not ev.query():
        return None
    return float(host.item())


class Pending:
    """Holders of a ring's rows whose device values have not landed yet: kept at a boundary (``keep``),
    read into their rows once ready (``resolve``: a few steps later on the training thread, or when a
    query asks). A row the ring has since overwritten is dropped."""

    __slots__ = ("ring", "what", "items", "_lock")

    def __init__(self, ring, what: str):
        self.ring, self.what = ring, what
        self.items: list = []  # (ring row, column, holder)
        self._lock = threading.Lock()

    def keep(self, row: int, values) -> int:
        """Keep the holders among ``values`` (``(column, value)`` pairs) for ``row``; returns how many wait."""
        with self._lock:
            for col, v in values:
                if type(v) is tuple:
                    self.items.append((row, col, v))
            return len(self.items)

    def resolve(self, up_to_row: int | None = None) -> None:
        """Read the values that have landed (of rows up to ``up_to_row`` if given) into their rows."""
        ring = self.ring
        with self._lock:
            keep = []
            for row, col, holder in self.items:
                if ring.count - row > ring.capacity:
                    continue
                if up_to_row is not None and row > up_to_row:
                    keep.append((row, col, holder))
                    continue
                try:
                    v = read(holder)
                except Exception as exc:
                    record_error(f"{self.what}: reading {col}", exc)
                    continue
                if v is None:
                    keep.append((row, col, holder))
                else:
                    ring.set(col, row, v)
            self.items = keep
