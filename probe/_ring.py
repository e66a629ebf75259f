"""A preallocated, fixed-capacity, columnar ring buffer.

Hooks append a few numbers (no Python row objects, no allocation once full); a
query takes ``snapshot()``, which copies the live region of each column with
numpy in oldest-to-newest order and hands the arrays to DuckDB without building
rows. The writer bumps ``count`` only after every column of a row is written, so
a reader never sees a half-written row (the GIL orders the stores).
"""

from __future__ import annotations

__all__ = ["Ring"]


class Ring:
    def __init__(self, columns: dict[str, str], capacity: int):
        """``columns`` maps name to a numpy dtype string ("f8", "i8", "b1", "O")."""
        import numpy as np

        if capacity < 1:
            raise ValueError("ring capacity must be at least 1")
        self.capacity = int(capacity)
        self.names = tuple(columns)
        self.arrays = {name: np.zeros(self.capacity, dtype=dt) for name, dt in columns.items()}
        self._cols = tuple(self.arrays[n] for n in self.names)
        self.count = 0  # rows ever appended

    def append(self, *values) -> None:
        i = self.count % self.capacity
        for arr, v in zip(self._cols, values):
            arr[i] = v
        self.count += 1

    def append_row(self, row: dict) -> None:
        self.append(*(row.get(n) for n in self.names))

    def __len__(self) -> int:
        return min(self.count, self.capacity)

    def snapshot(self) -> dict:
        """Columns oldest first; a copy, so writers may go on while DuckDB reads."""
        import numpy as np

        n = self.count
        if n <= self.capacity:
            return {name: arr[:n].copy() for name, arr in self.arrays.items()}
        start = n % self.capacity
        return {name: np.concatenate((arr[start:], arr[:start])) for name, arr in self.arrays.items()}

    def clear(self) -> None:
        self.count = 0
