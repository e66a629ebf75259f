"""The query path: the sqlglot guard, the DuckDB engine, and (for --ranks) federation.

This package never imports torch or ``probe.cli``.
"""

from .engine import Result, execute
from .guard import Guarded, guard

__all__ = ["Guarded", "Result", "execute", "guard"]
