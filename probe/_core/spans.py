"""Named spans from user code: ``with probe.span("data"):`` and ``@probe.span("eval")``.

A span records its name, the step in progress, its start and duration, its nesting
depth and parent on its thread, into the ``python.spans`` ring (and from there the
timeline of ``probe ENDPOINT trace``). While no probe runs in the process a span does
nothing but one check: user code can keep its spans in production.

Nesting is per thread: each thread keeps a stack of its open spans. A span object may
be entered several times at once (recursion, threads), since the open state lives on
the thread's stack, not on the object. Recording never raises into user code: a
failure is counted in ``probe.errors``.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time

from ..config import setting
from .._identity import rank_identity
from ..util.errorlog import record_error
from .boundary import boundary


SPAN_COLUMNS = {
    "name": "O",
    "step": "i8",
    "time": "f8",
    "duration": "f8",
    "depth": "i8",
    "parent": "O",
    "thread_id": "i8",
    "thread": "O",
    "rank": "f8",
}


class _Stack(threading.local):
    def __init__(self):
        self.stack: list = []  # (span, start) of this thread's open spans, innermost last


_local = _Stack()  # an attribute that always exists: a missing one would cost an exception per span
_state: dict = {}
_ring_lock = threading.Lock()


_lifecycle = []  # probe.agent.lifecycle once it is imported (a span never imports it: that would start nothing)


def _probe_on() -> bool:
    if not _lifecycle:
        mod = sys.modules.get("probe.agent.lifecycle")
        if mod is None:
            return False
        _lifecycle.append(mod)
    return _lifecycle[0].is_running()


def ring():
    """The spans ring, made on first use (None until a span was recorded)."""
    return _state.get("ring")


def _make_ring():
    with _ring_lock:
        r = _state.get("ring")
        if r is None:
            from ..util.ring import Ring

            r = Ring(SPAN_COLUMNS, setting("PROBE_SPANS_CAPACITY"))
            rank = rank_identity()["rank"]
            _state["rank"] = float("nan") if rank is None else float(rank)
            _state["wall_offset"] = time.time() - time.perf_counter()
            _state["ring"] = r
        return r


class span:
    """A named span of user code: a context manager and a decorator.

    ``name`` is free text (``data``, ``forward``, ``eval``, ``checkpoint``); the doctor and
    the timeline read spans named ``data`` as input-pipeline time.
    """

    __slots__ = ("name",)

    def __init__(self, name: str):
        if not isinstance(name, str) or not name.strip():
            raise TypeError("probe.span needs a name, e.g. probe.span('data').")
        self.name = name

    def __repr__(self) -> str:
        return f"probe.span({self.name!r})"

    def __enter__(self):
        if _probe_on():
            _local.stack.append((self, time.perf_counter()))
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        stack = _local.stack
        if stack and stack[-1][0] is self:
            _, t0 = stack.pop()
            try:
                self._record(t0, time.perf_counter(), len(stack), stack[-1][0].name if stack else None)
            except Exception as err:  # never into user code
                record_error("probe.span", err)
        return False

    def _record(self, t0: float, t1: float, depth: int, parent: str | None) -> None:
        r = _state.get("ring") or _make_ring()
        last = boundary.last_step
        t = threading.current_thread()
        r.append(
            self.name,
            (last or 0) + 1,
            t0 + _state["wall_offset"],
            t1 - t0,
            depth,
            parent,
            t.ident or 0,
            t.name,
            _state["rank"],
        )

    def __call__(self, fn):
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args, **kwargs):
                with self:
                    return await fn(*args, **kwargs)

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return wrapper
