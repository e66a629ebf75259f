"""The step boundary: the one place where the training thread hands control to the probe, between two steps.

Whatever ends a step (torch's optimizer step post-hook through the step tracker, ``probe.step()``, or a loop
that calls ``boundary.passed`` itself) goes through the one ``boundary`` object. Code that needs the training
thread registers with it; each registration is idempotent and undone by ``boundary.remove(fn)``::

    from probe._core.boundary import boundary

    boundary.before_step(fn)   # fn(optimizer) on the training thread before every optimizer step; what it
                               # returns, when callable, is called with the optimizer right after that step
                               # (before the step's row is written) and may return the lr the step used
    boundary.after_step(fn)    # fn(event) at every step boundary (a ``StepEvent``: step, frame, optimizer)
    boundary.heartbeat(fn)     # fn(step) at least once a second while steps complete, not at every step
    boundary.run_at_next_step(fn, timeout)  # fn() once, at the next boundary; its result or exception here
    boundary.last_step         # the step of the last boundary passed (None before the first)

A callback that raises is recorded in ``probe.errors`` and the others still run: nothing propagates into
training. ``after_step`` callbacks make every boundary a full one (the step tracker's quick path runs only while
none is registered), so register one only while there is work waiting (the action queue subscribes while an
action waits); ``heartbeat`` leaves the quick path in place: heartbeats run at every full boundary, which the
step tracker takes at least once a second while steps complete (its budget's floor).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..util.errorlog import record_error


class StepEvent:
    """One step boundary as ``after_step`` callbacks see it: the step, the training loop's frame (for its locals
    ``loss``, ``batch``, ...) and the optimizer whose step just finished, when known."""

    __slots__ = ("step", "frame", "optimizer")

    def __init__(self, step: int, frame=None, optimizer=None):
        self.step = step
        self.frame = frame
        self.optimizer = optimizer

    def __repr__(self) -> str:
        return f"StepEvent(step={self.step})"


class Boundary:
    """The step boundary of this process (one: ``boundary``): its registrations and the last step passed."""

    def __init__(self):
        self.before: list[Callable] = []  # lists are never rebound: the hot path reads them through one attribute
        self.after: list[Callable[[StepEvent], None]] = []
        self.beats: list[Callable[[int], None]] = []
        self.undo: dict[int, list] = {}  # id(optimizer) -> what its before_step callbacks run after its step
        self.last_step: int | None = None

    # -- registration ---------------------------------------------------------------------------------
    def before_step(self, fn: Callable) -> Callable:
        return _add(self.before, fn)

    def after_step(self, fn: Callable[[StepEvent], None]) -> Callable[[StepEvent], None]:
        return _add(self.after, fn)

    def heartbeat(self, fn: Callable[[int], None]) -> Callable[[int], None]:
        return _add(self.beats, fn)

    def remove(self, fn: Callable) -> None:
        """Undo a registration (any of the three); nothing when ``fn`` is not registered."""
        for registry in (self.before, self.after, self.beats):
            try:
                registry.remove(fn)
            except ValueError:
                pass

    # -- the training thread --------------------------------------------------------------------------
    def optimizer_starts(self, optimizer) -> None:
        """Before an optimizer step (torch's pre-hook): the ``before_step`` callbacks; what they return to run
        after the step is kept for ``optimizer_ended``."""
        undo = []
        for fn in tuple(self.before):
            try:
                then = fn(optimizer)
            except Exception as exc:
                record_error(f"before step {_name(fn)}", exc)
                continue
            if callable(then):
                undo.append(then)
        if undo:
            self.undo[id(optimizer)] = undo

    def optimizer_ended(self, optimizer) -> float | None:
        """Right after an optimizer step (torch's post-hook, before the step's row is written): what the
        ``before_step`` callbacks returned for it. Returns the lr the step used when one of them says so (else
        None: ``param_groups`` tells)."""
        used = None
        for then in self.undo.pop(id(optimizer), ()):
            try:
                lr = then(optimizer)
            except Exception as exc:
                record_error(f"after the optimizer step {_name(then)}", exc)
                continue
            if lr is not None:
                used = lr
        return used

    def passed(self, step: int, frame=None, optimizer=None) -> None:
        """Step ``step`` ended: ``last_step`` is written, the ``after_step`` callbacks and the heartbeats run. The
        step tracker's quick path writes ``last_step`` alone: it runs only while no callback is registered, and
        leaves the heartbeats to its full boundaries."""
        self.last_step = step
        if self.after:
            event = StepEvent(step, frame, optimizer)
            for fn in tuple(self.after):
                try:
                    fn(event)
                except Exception as exc:
                    record_error(f"step subscriber {_name(fn)}", exc)
        if self.beats:
            for fn in tuple(self.beats):
                try:
                    fn(step)
                except Exception as exc:
                    record_error(f"step heartbeat {_name(fn)}", exc)

    def run_at_next_step(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run ``fn()`` on the training thread at the next step boundary and return its result.

        For work that must not race the training thread, such as reading parameters and their ``.grad``
        (autograd writes gradients from its own threads, without the GIL). Raises TimeoutError when no boundary
        comes within ``timeout`` seconds (``fn`` then never runs); an exception from ``fn`` is raised here.
        """
        done = threading.Event()
        lock = threading.Lock()
        box: dict = {}

        def once(event: StepEvent) -> None:
            with lock:
                if box.get("state") is not None:
                    return
                box["state"] = "running"
            self.remove(once)
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the waiting thread, never raised into training
                box["error"] = exc
            finally:
                done.set()

        self.after_step(once)
        if not done.wait(timeout):
            with lock:
                started = box.get("state") is not None
                if not started:
                    box["state"] = "abandoned"
            if not started:
                self.remove(once)
                raise TimeoutError(f"no step boundary came within {timeout:g} s")
            done.wait()  # it began just now: it is short, wait for it
        if "error" in box:
            raise box["error"]
        return box.get("value")


def _add(registry: list, fn):
    if fn not in registry:
        registry.append(fn)
    return fn


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


boundary = Boundary()
