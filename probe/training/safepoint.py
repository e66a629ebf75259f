"""The step boundary: the one place where the training thread hands control to the probe.

Whatever detects a completed optimizer step (torch's global optimizer step post-hook,
or an explicit ``probe.step()``) calls ``fire``; subscribers registered with
``on_step`` then run on the training thread, between two steps: queued actions,
the hang watchdog's re-arm, step bookkeeping. A subscriber that raises is recorded in
``probe.errors`` and the others still run; nothing propagates into training.

Subscribers come and go: the action queue subscribes only while an action waits, so
a boundary with nobody subscribed only records ``last_step`` (the torch step tracker
skips building the event then, and takes its quick path).

Work that needs to know that steps still come, but not at every step, registers with
``on_heartbeat`` instead (the hang watchdog): ``beat(step)`` runs it at every ``fire`` and at
every boundary the step tracker runs in full, which it does at least once a second while
steps complete (its budget's floor, ``steps._MAX_GAP_S``), so heartbeats leave the quick
path in place.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..util.errorlog import record_error

__all__ = [
    "StepEvent",
    "on_step",
    "remove",
    "fire",
    "last_step",
    "run_at_next_step",
    "subscribers",
    "heartbeats",
    "on_heartbeat",
    "remove_heartbeat",
    "beat",
]


class StepEvent:
    """One step boundary as seen by subscribers (a plain slotted class: one is made per step).

    ``frame`` is the training loop's frame (for the locals ``loss``, ``batch``, ...) and
    ``optimizer`` the optimizer whose step just finished, when known.
    """

    __slots__ = ("step", "frame", "optimizer")

    def __init__(self, step: int, frame=None, optimizer=None):
        self.step = step
        self.frame = frame
        self.optimizer = optimizer

    def __repr__(self) -> str:
        return f"StepEvent(step={self.step})"


subscribers: list[Callable[[StepEvent], None]] = []  # empty: the step tracker's quick path may run
last_step: int | None = None  # the step of the last boundary passed (set even when nobody subscribes)


def on_step(fn: Callable[[StepEvent], None]) -> Callable[[StepEvent], None]:
    """Run ``fn(event)`` at every step boundary, on the training thread. Idempotent."""
    return _add(subscribers, fn)


def remove(fn: Callable[[StepEvent], None]) -> None:
    _drop(subscribers, fn)


def fire(event: StepEvent) -> None:
    global last_step
    last_step = event.step
    _call_each(subscribers, event, "step subscriber")
    if heartbeats:
        beat(event.step)


heartbeats: list[Callable[[int], None]] = []  # run by ``beat``: not at every step, and never in the quick path's way


def on_heartbeat(fn: Callable[[int], None]) -> Callable[[int], None]:
    """Run ``fn(step)`` on the training thread at least once a second while steps complete (see the module's
    docstring), not necessarily at every step. Idempotent."""
    return _add(heartbeats, fn)


def remove_heartbeat(fn: Callable[[int], None]) -> None:
    _drop(heartbeats, fn)


def beat(step: int) -> None:
    """The heartbeat subscribers' turn (``fire``, and the step tracker's full boundaries)."""
    _call_each(heartbeats, step, "step heartbeat")


def _add(registry: list, fn):
    if fn not in registry:
        registry.append(fn)
    return fn


def _drop(registry: list, fn) -> None:
    try:
        registry.remove(fn)
    except ValueError:
        pass


def _call_each(registry: list, arg, what: str) -> None:
    """Call each of ``registry`` with ``arg``; one that raises is recorded and the others still run."""
    for fn in tuple(registry):
        try:
            fn(arg)
        except Exception as exc:
            record_error(f"{what} {getattr(fn, '__qualname__', fn)}", exc)


def run_at_next_step(fn: Callable[[], Any], timeout: float) -> Any:
    """Run ``fn()`` on the training thread at the next step boundary and return its result.

    For work that must not race the training thread, such as reading parameters and
    their ``.grad`` (autograd writes gradients from its own threads, without the GIL).
    Raises TimeoutError when no boundary comes within ``timeout`` seconds (a hung or
    very slow step); ``fn`` then never runs. An exception from ``fn`` is raised here.
    """
    done = threading.Event()
    lock = threading.Lock()
    box: dict = {}

    def once(event: StepEvent) -> None:
        with lock:
            if box.get("state") is not None:
                return
            box["state"] = "running"
        remove(once)
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the waiting thread, never raised into training
            box["error"] = exc
        finally:
            done.set()

    on_step(once)
    if not done.wait(timeout):
        with lock:
            started = box.get("state") is not None
            if not started:
                box["state"] = "abandoned"
        if not started:
            remove(once)
            raise TimeoutError(f"no step boundary came within {timeout:g} s")
        done.wait()  # it began just now: it is short, wait for it
    if "error" in box:
        raise box["error"]
    return box.get("value")
