"""Every step's memory reading, at no cost to the training thread: a clock thread of its own.

A daemon thread reads the process's memory every ``PERIOD`` seconds while steps come (once a
second while none do) into a small ring of (time, in use, peak) readings: on a CUDA run the
caching allocator's ``memory_allocated`` and ``max_memory_allocated`` of the training thread's
device (no device sync: host-side counters), else the resident set size (``/proc/self/statm``)
and the peak RSS (``getrusage``). ``torch.steps`` joins each step to the reading nearest its end
(``at``), so every step carries one; steps shorter than the period share a reading, and a step
with no reading within ``JOIN_S`` of its end (the clock had not started, or had stopped) has
NULL. The training thread only tells the clock, at full step boundaries, which CUDA device it uses.
"""

from __future__ import annotations

import resource
import threading
import time

from ..util.errorlog import record_error
from ..util.procfs import RssReader
from ..util.ring import Ring

__all__ = ["MemoryClock", "PERIOD"]

PERIOD = 0.1  # seconds between readings while steps come
IDLE_PERIOD = 1.0  # ... and while none do
JOIN_S = 1.0  # a step takes the reading nearest its end when one is this close
CAPACITY = 36_000  # an hour of readings at PERIOD


class MemoryClock:
    def __init__(self, torch, steps=lambda: 0):
        self.torch = torch
        self.steps = steps  # the tracker's step count: the clock reads faster while it moves
        self.ring = Ring({"at": "f8", "memory": "f8", "peak": "f8"}, CAPACITY)
        self.device = None  # the training thread's CUDA device index, once CUDA is in use
        self._thread = None
        self._stop = threading.Event()
        self._rss = None
        self._failed = False

    def tick(self) -> None:
        """At a full step boundary (training thread): start the clock, and note the CUDA device in use."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(self._stop,), name="probe-memory", daemon=True)
            self._thread.start()
        if self.device is None:
            try:
                cuda = self.torch.cuda
                if cuda.is_initialized():
                    self.device = cuda.current_device()
            except Exception as exc:
                record_error("torch memory clock: the CUDA device", exc)

    def read(self) -> None:
        """One reading into the ring (the clock's thread, or a test)."""
        device = self.device
        if device is not None:
            cuda = self.torch.cuda
            memory = float(cuda.memory_allocated(device))
            peak = float(cuda.max_memory_allocated(device))
        else:
            if self._rss is None:
                self._rss = RssReader()
            memory = self._rss()
            peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        self.ring.append(time.time(), memory, peak)

    def _run(self, stop: threading.Event) -> None:
        last = None
        wait = 0.0
        while not stop.wait(wait):
            try:
                self.read()
            except Exception as exc:
                if not self._failed:
                    self._failed = True
                    record_error("torch memory clock", exc)
            step = self.steps()
            wait = PERIOD if step != last else IDLE_PERIOD
            last = step

    def stop(self) -> None:
        """Stop the clock thread (the probe paused or closed); the next ``tick`` starts a new one."""
        self._stop.set()
        self._stop = threading.Event()
        self._thread = None

    def at(self, ended_at):
        """(in use, peak) for steps ending at ``ended_at`` (wall seconds, ascending): each the reading
        nearest the step's end within ``JOIN_S``, else missing (masked arrays)."""
        import numpy as np

        cols = self.ring.snapshot()
        at = np.asarray(cols["at"], dtype="f8")
        n = len(ended_at)
        if not len(at) or not n:
            empty = np.ma.masked_all(n, dtype="f8")
            return empty, empty.copy()
        ends = np.asarray(ended_at, dtype="f8")
        right = np.clip(np.searchsorted(at, ends), 0, len(at) - 1)
        left = np.clip(right - 1, 0, len(at) - 1)
        nearest = np.where(np.abs(at[left] - ends) <= np.abs(at[right] - ends), left, right)
        far = np.abs(at[nearest] - ends) > JOIN_S
        memory = np.ma.masked_array(np.asarray(cols["memory"], dtype="f8")[nearest], mask=far)
        peak = np.ma.masked_array(np.asarray(cols["peak"], dtype="f8")[nearest], mask=far)
        return memory, peak
