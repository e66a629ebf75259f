"""Device values copied off the device without blocking (a pinned host copy and an event, ``Capture.hold``):
read into their rows of a ring once the copy has landed, never by waiting for the device."""

from __future__ import annotations

import threading

from ..util.errorlog import record_error

__all__ = ["Pending", "read", "landed"]


def read(holder):
    """The value behind a holder from ``Capture.hold``, or None while its device copy has not landed."""
    host, ev = holder
    if ev is not None and not ev.query():
        return None
    return float(host.item())


class _OnHost(float):
    """A value already on the host, in a holder's place (``landed``)."""

    def item(self) -> float:
        return float(self)


def landed(value: float) -> tuple:
    """A holder whose value has landed already: a host value that must wait in line behind device values."""
    return (_OnHost(value), None)


class Pending:
    """Holders of a ring's rows whose device values have not landed yet: kept at a boundary (``keep``),
    read into their rows once ready (``resolve``: a few steps later on the training thread, or when a
    query asks). A row the ring has since overwritten is dropped."""

    __slots__ = ("ring", "what", "items", "_lock")

    def __init__(self, ring, what: str):
        self.ring, self.what = ring, what
        self.items: list = []  # (ring row, column, holder)
        self._lock = threading.Lock()

    def keep(self, row: int, values, add: bool = False) -> int:
        """Keep the holders among ``values`` (``(column, value)`` pairs) for ``row``; returns how many wait.
        ``add``: each value is added to the cell once read (after the values kept for that cell before it)."""
        with self._lock:
            for col, v in values:
                if type(v) is tuple:
                    self.items.append((row, col, v, add))
            return len(self.items)

    def waits(self, row: int, col: str) -> bool:
        """Whether a value of ``row``'s ``col`` has not landed yet."""
        with self._lock:
            return any(r == row and c == col for r, c, _, _ in self.items)

    def resolve(self, up_to_row: int | None = None) -> None:
        """Read the values that have landed (of rows up to ``up_to_row`` if given) into their rows."""
        ring = self.ring
        with self._lock:
            keep = []
            for item in self.items:
                row, col, holder, add = item
                if ring.count - row > ring.capacity:
                    continue
                if (up_to_row is not None and row > up_to_row) or (
                    add and any(r == row and c == col for r, c, _, _ in keep)  # what it adds to has not landed
                ):
                    keep.append(item)
                    continue
                try:
                    v = read(holder)
                except Exception as exc:
                    record_error(f"{self.what}: reading {col}", exc)
                    continue
                if v is None:
                    keep.append(item)
                    continue
                if add:
                    v += ring.get(col, row) or 0.0
                ring.set(col, row, v)
            self.items = keep
