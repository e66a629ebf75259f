"""The ``probe`` command. It never imports torch and imports duckdb/sqlglot only
in the commands that need them, so ``probe PID backtrace`` starts fast."""

from .plumbing.main import entry, main

__all__ = ["entry", "main"]
