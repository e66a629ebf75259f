"""``GET /profile``: sample every thread's Python stack for a few seconds (a flamegraph's data).

The sampler runs on the request's server thread: it reads ``sys._current_frames()`` about
``hz`` times a second for ``seconds`` (both bounded), keys each stack by its code objects
(no strings built while sampling) and only turns the distinct stacks into text at the end.
Between samples it sleeps, so the training thread keeps the GIL. A profile is charged to its
listener's share (``pacing``, ``PROBE_SERVE_SHARE``) as it samples: it starts when the share has
credit, and while the share is spent it pauses (fewer samples, ``paced_s`` says how long). One
profile runs at a time per listener; a second request is refused with a sentence saying so.

The answer is collapsed stacks, root first: ``thread MainThread;main (train.py:90);...``
with a sample count each, the format flamegraph tools read.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from . import pacing
from .._core import state
from ..config import setting
from ..util import validate as v
from .._errors import QueryError
from .routing import Request, route
from ..util.collapsed import frame_text

__all__ = ["sample_stacks", "MAX_SECONDS", "MAX_HZ"]

MAX_SECONDS = 60.0
MAX_HZ = 250.0
DEFAULT_HZ = 100.0
MAX_STACKS = 20000  # distinct stacks kept; further new ones are counted as dropped
MAX_DEPTH = 256
_CHARGE_EVERY = 10  # samples between two charges to the lane


def _label(code) -> str:
    """``func (file.py:first line)``: one box per function, whichever line it is on."""
    name = getattr(code, "co_qualname", None) or code.co_name
    return frame_text(f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})")


def sample_stacks(seconds: float, hz: float = DEFAULT_HZ, exclude: frozenset = frozenset(), lane=None) -> dict:
    """Sample all threads but ``exclude`` for ``seconds`` at ``hz``; return collapsed stacks with counts.

    With ``lane`` (``pacing.Lane``), the thread's CPU time is charged to it every few samples, and
    sampling pauses while its share is spent."""
    counts: dict[tuple, int] = {}
    charged = 0  # CPU time of this thread charged to the lane so far
    paced = 0.0
    dropped = 0
    names: dict[int, str] = {}
    interval = 1.0 / hz
    start = time.monotonic()
    deadline = start + seconds
    next_at = start
    samples = 0
    while True:
        now = time.monotonic()
        if now >= deadline:
            break
        if samples % 50 == 0:  # threads come and go; their names are cheap to refresh now and then
            names.update({t.ident: t.name for t in threading.enumerate() if t.ident is not None})
        frames = sys._current_frames()
        for ident, frame in frames.items():
            if ident in exclude:
                continue
            codes = []
            while frame is not None and len(codes) < MAX_DEPTH:
                codes.append(frame.f_code)
                frame = frame.f_back
            key = (ident, tuple(codes))
            if key in counts:
                counts[key] += 1
            elif len(counts) < MAX_STACKS:
                counts[key] = 1
            else:
                dropped += 1
        del frames, frame
        samples += 1
        if lane is not None and samples % _CHARGE_EVERY == 0:
            spent = time.thread_time_ns()
            lane.charge(spent - charged)
            charged = spent
            pause = min(lane.wait_s(), deadline - time.monotonic())
            if pause > 0:
                time.sleep(pause)  # ok-sleep: the share is spent; the training thread has the GIL meanwhile
                paced += pause
                next_at = time.monotonic()
                continue
        next_at += interval
        pause = next_at - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # ok-sleep: the sampling interval; the GIL is free meanwhile
        else:
            next_at = time.monotonic()  # fell behind (a busy GIL): sample again at once, never in a burst
    elapsed = time.monotonic() - start
    if lane is not None:
        lane.charge(time.thread_time_ns() - charged)
    labels: dict = {}
    stacks: dict[str, int] = {}
    for (ident, codes), n in counts.items():
        parts = [frame_text(f"thread {names.get(ident, ident)}")]
        for code in reversed(codes):
            text = labels.get(code)
            if text is None:
                text = labels[code] = _label(code)
            parts.append(text)
        key = ";".join(parts)
        stacks[key] = stacks.get(key, 0) + n
    return {
        "samples": samples,
        "seconds": round(elapsed, 3),
        "hz": hz,
        "dropped": dropped,
        "paced_s": round(paced, 3),
        "stacks": sorted(([k, v] for k, v in stacks.items()), key=lambda kv: -kv[1]),
    }


def _number(req: Request, name: str, default: float, low: float, high: float) -> float:
    value = req.param(name, default)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise QueryError(f"{name} must be a number, got {value!r}.") from None
    if not low < value <= high:
        raise QueryError(f"{name} must be above {low:g} and at most {high:g}, got {value:g}.")
    return value


@route("GET", "/profile")
def profile(req: Request) -> dict:
    seconds = _number(req, "seconds", 5.0, 0.0, MAX_SECONDS)
    hz = _number(req, "hz", DEFAULT_HZ, 0.0, MAX_HZ)
    wait = v.seconds(req.param("wait"), "wait", default=setting("PROBE_QUERY_TIMEOUT"))  # for the share, at most
    lane = pacing.lane(req.client.get("transport"))
    if not lane.profiling.acquire(blocking=False):
        raise QueryError("a profile is already running in this process; wait for it to finish and ask again.")
    try:
        lane.paced(wait, "profile")
        doc = sample_stacks(seconds, hz, exclude=frozenset({threading.get_ident()}), lane=lane)
    finally:
        lane.profiling.release()
    entry = state.info()
    doc.update(source="probe", pid=entry.get("pid"), rank=entry.get("rank"))
    return doc
