"""The built-in tables. Each module registers its tables with ``@table`` on import,
exactly as a user's own table would; this list is the only place they are named."""

from . import actions, checks, collectives, data, diagnosis, loss, meta, process, python, replicas, spans, syncs, torch  # noqa: F401

__all__ = []
