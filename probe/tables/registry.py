"""The table registry: one declaration per table, the single source for everything.

A table is declared once, with its generator (docs/architecture.md, "Adding things", shows one).
The declaration drives query execution, completion, ``probe.tables`` and
``probe.columns``, docs/reference.md and the test suite (every example runs).
Built-in tables register exactly the way a user's own table would: ``BUILTIN`` names their
modules, which the registry imports by name the first time anyone reads it (``all_tables``,
``get_table``, ``version``), so that no reader has to remember an import for its side effect.

A generator receives a :class:`Context` and returns either rows (tuples in column
order, or dicts by column name) or columns (a dict of column name to a sequence or
numpy array, which is what ring buffers return: DuckDB reads those without a copy).
"""

from __future__ import annotations

import importlib
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..util.wire import Column, WireError, check_table


# the modules of probe.tables that declare the built-in tables (the only place they are named)
BUILTIN = (
    "checks",
    "collectives",
    "data",
    "diagnosis",
    "meta",
    "optim",
    "process",
    "python",
    "torch",
)

KINDS = ("snapshot", "ring", "client")
_NAME = re.compile(r"^[a-z_][a-z0-9_]*\.[a-z_][a-z0-9_]*$")


@dataclass(frozen=True)
class Table:
    name: str
    description: str
    columns: tuple[Column, ...]
    generator: Callable[["Context"], Any]
    examples: tuple[str, ...] = ()
    # "snapshot": built at query time; "ring": a bounded history appended as events happen;
    # "client": computed by the client (the probe CLI) over the other tables, empty in a process's own snapshot
    kind: str = "snapshot"

    @property
    def schema(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def short(self) -> str:
        return self.name.split(".", 1)[1]

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]


@dataclass
class Context:
    """What a generator may use: the time of the snapshot and per-query hints."""

    time: float = field(default_factory=time.time)
    hints: dict = field(default_factory=dict)
    exclude_threads: frozenset = frozenset()


_REGISTRY: dict[str, Table] = {}
_LOCK = threading.Lock()
_VERSION = [0]  # bumped by every (un)registration: clients key their cached schema on it


def table(
    name: str, description: str, *, columns: Iterable[Column], examples: Iterable[str] = (), kind: str = "snapshot"
):
    """Register the decorated generator as table ``name`` (``schema.table``, lower case)."""
    if not _NAME.match(name):
        raise ValueError(f"table name {name!r} must look like schema.table in lower case")
    if not description.endswith("."):
        raise ValueError(f"table {name}: its description must be a sentence ending in a period")
    if kind not in KINDS:
        raise ValueError("kind must be 'snapshot', 'ring' or 'client'")
    cols = tuple(columns)
    if len({c.name for c in cols}) != len(cols):
        raise ValueError(f"table {name}: duplicate column names")
    try:  # what a client will accept of a snapshot (probe.util.wire): refuse here what it would refuse there
        check_table(name, [(c.name, c.type) for c in cols])
    except WireError as exc:
        raise ValueError(str(exc)) from None

    def register(fn):
        with _LOCK:
            _REGISTRY[name] = Table(name, description, cols, fn, tuple(examples), kind)
            _VERSION[0] += 1
        return fn

    return register


def unregister(name: str) -> None:
    with _LOCK:
        if _REGISTRY.pop(name, None) is not None:
            _VERSION[0] += 1


_LOADED: list[bool] = []


def load_builtins() -> None:
    """Import the built-in tables' modules (once; each registers its tables with ``@table``).

    The readers below call it; the agent calls it at start, so that a query, or the post-mortem
    record written while the interpreter exits, never has to import a module first.
    """
    if _LOADED:
        return
    for mod in BUILTIN:
        importlib.import_module(f"{__package__}.{mod}")
    _LOADED.append(True)


def version() -> int:
    """A number that changes whenever a table is registered or removed (the schema's version)."""
    load_builtins()
    return _VERSION[0]


def get_table(name: str) -> Table | None:
    load_builtins()
    return _REGISTRY.get(name.lower())


def all_tables() -> list[Table]:
    load_builtins()
    with _LOCK:
        return sorted(_REGISTRY.values(), key=lambda t: t.name)


def no_rows(columns) -> dict:
    """A ring table's answer before its ring exists: each of ``columns`` (names) with no values."""
    return {name: [] for name in columns}


def ring_rows(owner, columns, read: Callable[[Any], Any]) -> Any:
    """A ring table's answer: ``read(owner)``, or no rows (``no_rows``) while its owner does not exist yet."""
    return no_rows(columns) if owner is None else read(owner)


def to_columns(tbl: Table, data: Any) -> dict:
    """Normalise a generator's output to ``{column: sequence}`` in declaration order."""
    names = tbl.column_names
    if isinstance(data, dict):
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"table {tbl.name}: generator did not return columns {missing}")
        return {n: data[n] for n in names}
    rows = list(data or ())
    if rows and isinstance(rows[0], dict):
        return {n: [r.get(n) for r in rows] for n in names}
    out: dict[str, list] = {n: [] for n in names}
    for r in rows:
        if len(r) != len(names):
            raise ValueError(f"table {tbl.name}: a row has {len(r)} values for {len(names)} columns")
        for n, v in zip(names, r):
            out[n].append(v)
    return out
