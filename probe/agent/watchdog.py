"""The hang watchdog: all-thread stacks on disk when no step completes for PROBE_HANG_TIMEOUT seconds.

It uses ``faulthandler.dump_traceback_later``, whose timer is a C thread that writes
the stacks without taking the GIL, so it works even when the training thread is
stuck inside a C call with the GIL held (an NCCL collective, a CUDA sync, a
deadlocked extension), where no Python thread, the probe server's included, can run.

The timer is armed when the probe starts and re-armed as steps complete, from a
``probe.training.safepoint`` heartbeat: at least once a second while steps come, not at every
step (re-arming stops faulthandler's timer thread and starts a new one: tens of microseconds,
and a full step boundary, at every step of a fast loop). So that a heartbeat's lag can never make
it fire early, it is re-armed at most every ``REARM_S`` and for ``S + LATE_S`` seconds: it fires
when ``S`` to ``S + LATE_S`` seconds pass without a step. Nothing polls: the dump is noticed when
someone asks for the status (``probe list``, ``/health``, ``process.info``), by one ``fstat`` of
the dump file, which grows only when faulthandler writes to it.

One ``Watchdog`` belongs to the running session (``probe.agent.lifecycle``), which starts it,
stops it and tells it about forks.
"""

from __future__ import annotations

import faulthandler
import os
import time

from ..config import setting
from .._runtime import runtime_dir
from ..training import safepoint
from ..util.errorlog import record_error

__all__ = ["Watchdog", "REARM_S", "LATE_S"]

REARM_S = 0.25  # heartbeats closer than this to the last re-arm leave the timer as it is
# how late, after S seconds without a step, the timer may fire: a heartbeat comes at most a second (and one step)
# after the last step it follows, and the re-arm may have been skipped for REARM_S before that
LATE_S = 1.5
_clock = time.monotonic


class Watchdog:
    """The armed timer and its dump file (``hang-<pid>.txt`` in the runtime directory)."""

    def __init__(self, timeout: float, path: str):
        self.timeout, self.path = timeout, path
        self.file = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a")
        self._arm()
        safepoint.on_heartbeat(self._on_heartbeat)

    @classmethod
    def start(cls) -> Watchdog | None:
        """A running watchdog when PROBE_HANG_TIMEOUT is set, else None; never raises into the caller."""
        try:
            seconds = setting("PROBE_HANG_TIMEOUT")
            if seconds is None:
                return None
            return cls(seconds, os.path.join(runtime_dir(), f"hang-{os.getpid()}.txt"))
        except Exception as exc:
            record_error("hang watchdog", exc)
            return None

    def _arm(self) -> None:
        faulthandler.dump_traceback_later(self.timeout + LATE_S, repeat=False, file=self.file, exit=False)
        self.beat_at = time.time()  # the arming counts as the last sign of life until a step is heard
        self.armed_mono = _clock()
        self.armed_size = os.fstat(self.file.fileno()).st_size

    def _on_heartbeat(self, step: int) -> None:
        self.beat_at = time.time()
        if _clock() - self.armed_mono >= REARM_S:
            self._arm()

    def stop(self) -> None:
        """Disarm the timer and close the dump file (the file itself stays for the user)."""
        safepoint.remove_heartbeat(self._on_heartbeat)
        faulthandler.cancel_dump_traceback_later()
        try:
            self.file.close()
        except OSError:
            pass

    def status(self) -> dict:
        """``state="hung"`` and ``hung_since`` (the last heartbeat: within a second of the last step, or the arming)
        once the timer has written stacks."""
        try:
            st = os.stat(self.path)
        except OSError:
            return {}
        out = {"hang_timeout": self.timeout, "hang_dump": self.path}
        if st.st_size > self.armed_size:
            out.update(state="hung", hung_since=self.beat_at, hang_detected_at=st.st_mtime)
        return out

    # A child forked while the C timer runs inherits its lock held and hangs at exit (faulthandler cannot cancel a
    # thread that fork did not copy): the timer is disarmed around fork, and a child never writes the parent's dumps.
    def before_fork(self) -> None:
        faulthandler.cancel_dump_traceback_later()

    def after_fork_in_parent(self) -> None:
        remaining = self.timeout + LATE_S - (_clock() - self.armed_mono)
        faulthandler.dump_traceback_later(max(remaining, 0.001), repeat=False, file=self.file, exit=False)

    def after_fork_in_child(self) -> None:
        safepoint.remove_heartbeat(self._on_heartbeat)
