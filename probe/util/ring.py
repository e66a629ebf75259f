"""A preallocated, fixed-capacity, columnar ring buffer.

Writers on the training thread pay as little as possible: ``append`` adds one tuple
to a Python list (the *tail*), and every ``FLUSH_ROWS`` rows the tail is
written into the preallocated numpy columns in one vectorised assignment per
column. Sixteen numpy scalar stores per row cost more than the whole rest of a step
boundary; one list append does not. A writer that calls ``append`` at least every ``room()``
rows may put rows on ``tail`` itself (counting them in ``count``), and a row may end early:
its missing last cells are None (SQL NULL, false in a boolean column; an integer column
cannot take one). ``extend`` writes many rows given as arrays.

Readers (a query on the server thread) call ``snapshot()``, which first flushes the
tail, then copies the live region of each column oldest first and hands the arrays
to DuckDB without building rows. Flushes take a lock, so a reader and the writer
never interleave a flush; ``append`` itself takes no lock (a list append is atomic
under the GIL, and a flush removes only the rows it copied).

A float column tells a missing value from a NaN: ``None`` (in ``append`` or ``set``) or a
masked entry (a ``numpy.ma`` array given to ``extend``) is missing and reads as SQL NULL,
while NaN and infinities are values (a loss gone NaN must stay NaN). Each float column
keeps a validity mask beside it; ``snapshot`` returns a masked array for a float column
that has missing rows in the live region, a plain array otherwise.

A device value (a CUDA tensor) reaches its row without the writer waiting for the device: ``copy_off`` starts a
non-blocking copy to pinned host memory and records an event (the pair is a *holder*; ``landed`` makes one of a
value already on the host), ``Pending`` keeps the holders of a ring's rows and ``resolve`` reads those whose copy
has landed (``read``) into their rows. Nothing here imports torch: the caller passes it.
"""

from __future__ import annotations

import threading
from itertools import zip_longest

from .errorlog import record_error

__all__ = ["Ring", "FLUSH_ROWS", "Pending", "copy_off", "landed", "read"]

FLUSH_ROWS = 1024  # numpy's per-call cost is paid per column per flush: batch generously


class Ring:
    def __init__(self, columns: dict[str, str], capacity: int):
        """``columns`` maps name to a numpy dtype string ("f8", "i8", "b1", "O")."""
        import numpy as np

        if capacity < 1:
            raise ValueError("ring capacity must be at least 1")
        self.capacity = int(capacity)
        self.names = tuple(columns)
        self.arrays = {name: np.zeros(self.capacity, dtype=dt) for name, dt in columns.items()}
        self._dtypes = {name: np.dtype(dt) for name, dt in columns.items()}
        # False where a float column's value is missing (None), as opposed to NaN
        self.valid = {name: np.ones(self.capacity, dtype=bool) for name, dt in self._dtypes.items() if dt.kind == "f"}
        self.count = 0  # rows ever appended: the next row's number
        self._stored = 0  # rows written into the arrays
        self.tail: list = []  # rows appended since, as tuples in column order (never rebound)
        self._lock = threading.Lock()
        self._flush_at = min(FLUSH_ROWS, self.capacity)

    def append(self, *values) -> None:
        tail = self.tail
        tail.append(values)
        self.count += 1
        if len(tail) >= self._flush_at:
            self.flush()

    def room(self) -> int:
        """Rows the tail takes before ``append`` flushes it: a writer adding rows to ``tail`` itself calls
        ``append`` by then."""
        return self._flush_at - len(self.tail)

    def flush(self) -> None:
        """Write the tail into the columns."""
        import numpy as np

        with self._lock:
            tail = self.tail
            n = len(tail)
            if not n:
                return
            rows = tail[:n]
            del tail[:n]
            cap = self.capacity
            skip = max(0, n - cap)
            idx = (self._stored + skip + np.arange(n - skip)) % cap
            cells = zip_longest(*rows[skip:])  # a short row's last cells are None; so are columns no row reached
            for name, values in zip_longest(self.names, cells, fillvalue=(None,) * (n - skip)):
                if self._dtypes[name].kind == "O":  # assigned element-wise: a tuple value stays one value
                    col = np.empty(n - skip, dtype=object)
                    col[:] = values
                elif name in self.valid:
                    missing = values.count(None)  # a C loop: a column wholly missing (or present) costs no look
                    if missing == len(values):
                        col = _NAN
                        self.valid[name][idx] = False
                    else:
                        col = np.array(values, dtype=self._dtypes[name])  # None becomes NaN
                        self.valid[name][idx] = _present(values, col) if missing else True
                else:
                    col = np.array(values, dtype=self._dtypes[name])
                self.arrays[name][idx] = col
            self._stored += n

    def extend(self, columns: dict, n: int) -> None:
        """Append ``n`` rows given as equal-length arrays, one vectorised write per column."""
        import numpy as np

        if n <= 0:
            return
        self.flush()
        with self._lock:
            cap = self.capacity
            skip = max(0, n - cap)
            idx = (self._stored + skip + np.arange(n - skip)) % cap
            for name, values in columns.items():
                values = values[skip:] if skip else values
                if name in self.valid:
                    self.valid[name][idx] = ~np.ma.getmaskarray(values)
                    values = np.ma.getdata(values)
                self.arrays[name][idx] = values
            self._stored += n
            self.count += n

    def set(self, name: str, row: int, value) -> bool:
        """Overwrite one cell of row number ``row`` (None: missing); False if that row has left the ring."""
        if self.count - row > self.capacity or row < 0:
            return False
        if row >= self._stored:
            self.flush()
        with self._lock:
            valid = self.valid.get(name)
            if valid is not None:
                valid[row % self.capacity] = value is not None
                if value is None:
                    value = _NAN
            self.arrays[name][row % self.capacity] = value
        return True

    def get(self, name: str, row: int):
        """The value of one cell of row number ``row`` (None: missing, or the row has left the ring)."""
        if self.count - row > self.capacity or row < 0 or row >= self.count:
            return None
        if row >= self._stored:
            self.flush()
        with self._lock:
            valid = self.valid.get(name)
            if valid is not None and not valid[row % self.capacity]:
                return None
            return self.arrays[name][row % self.capacity].item()

    def __len__(self) -> int:
        return min(self.count, self.capacity)

    def snapshot(self) -> dict:
        """Columns oldest first; a copy, so writers may go on while DuckDB reads."""
        import numpy as np

        self.flush()
        with self._lock:
            n = self._stored
            if n <= self.capacity:

                def live(arr):
                    return arr[:n].copy()
            else:
                start = n % self.capacity

                def live(arr):
                    return np.concatenate((arr[start:], arr[:start]))

            out = {}
            for name, arr in self.arrays.items():
                out[name] = live(arr)
                valid = self.valid.get(name)
                if valid is not None and not valid[: min(n, self.capacity)].all():
                    out[name] = np.ma.masked_array(out[name], mask=~live(valid))
            return out


_NAN = float("nan")


def _present(values: tuple, col):
    """Validity of a float column written by ``flush``: only its NaN cells need a look (None or NaN?)."""
    import numpy as np

    valid = np.ones(len(col), dtype=bool)
    nan = np.flatnonzero(np.isnan(col))
    if len(nan):
        valid[nan] = [values[i] is not None for i in nan.tolist()]
    return valid


# -- device values read into rows once they have landed --------------------------------------------
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


def copy_off(torch, t) -> tuple:
    """``(pinned host copy, event)`` of device tensor ``t`` (of a host one: itself), copied without blocking: read the
    copy once the event has completed."""
    host = t
    if t.is_cuda:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return host, ev


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
