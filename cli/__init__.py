"""The ``probe`` command. It never imports torch and imports duckdb/sqlglot only
in the commands that need them, so ``probe PID backtrace`` starts fast."""

from .plumbing.main import main

__all__ = ["main"]
