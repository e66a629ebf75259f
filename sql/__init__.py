"""The query path: the sqlglot guard, the DuckDB engine, and (for --ranks) federation.

This package never imports torch or ``probe.cli``. Its modules are imported on
first use (sqlglot and DuckDB are not free to import).
"""

from __future__ import annotations

import importlib

__all__ = ["Guarded", "Result", "execute"]

# ``guard`` (the function) is imported from ``probe.sql.guard``: re-exporting it here would
# be shadowed by the submodule of the same name as soon as that is imported.
_LAZY = {"Guarded": "guard", "Result": "engine", "execute": "engine"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'probe.sql' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
