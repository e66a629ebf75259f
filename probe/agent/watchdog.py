"""The hang watchdog: all-thread stacks on disk when no step completes for PROBE_HANG_TIMEOUT seconds.

It uses ``faulthandler.dump_traceback_later``, whose timer is a C thread that writes
the stacks without taking the GIL, so it works even when the training thread is
stuck inside a C call with the GIL held (an NCCL collective, a CUDA sync, a
deadlocked extension), where no Python thread, the probe server's included, can run.

The timer is armed when the probe starts and re-armed as steps complete, from a
``probe._core.boundary`` heartbeat: at least once a second while steps come, not at every
step (re-arming stops faulthandler's timer thread and starts a new one: tens of microseconds,
and a full step boundary, at every step of a fast loop). So that a heartbeat's lag can never make
it fire early, it is re-armed at most every ``REARM_S`` and for ``S + LATE_S`` seconds: it fires
when ``S`` to ``S + LATE_S`` seconds pass without a step. Nothing polls: the dump is noticed when
someone asks for the status (``probe list``, ``/health``, ``process.info``), by one ``fstat`` of
the dump file, which grows only when faulthandler writes to it.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time

from ..config import setting
from .._runtime import runtime_dir
from .._core.boundary import boundary
from ..util.errorlog import record_error
from .._core import state

__all__ = ["install", "uninstall", "status", "dump_path", "REARM_S", "LATE_S"]

REARM_S = 0.25  # heartbeats closer than this to the last re-arm leave the timer as it is
# how late, after S seconds without a step, the timer may fire: a heartbeat comes at most a second (and one step)
# after the last step it follows, and the re-arm may have been skipped for REARM_S before that
LATE_S = 1.5
_clock = time.monotonic

_lock = threading.Lock()
_state: dict = {}


def dump_path() -> str | None:
    """The file the stacks go to (``hang-<pid>.txt`` in the runtime directory), once installed."""
    return _state.get("path")


def _arm() -> None:
    faulthandler.dump_traceback_later(_state["timeout"] + LATE_S, repeat=False, file=_state["file"], exit=False)
    _state["beat_at"] = time.time()  # the arming counts as the last sign of life until a step is heard
    _state["armed_mono"] = _clock()
    _state["armed_size"] = os.fstat(_state["file"].fileno()).st_size


def _on_heartbeat(step: int) -> None:
    if _state:
        _state["beat_at"] = time.time()
        if _clock() - _state["armed_mono"] >= REARM_S:
            _arm()


def install() -> bool:
    """Arm the watchdog when PROBE_HANG_TIMEOUT is set; idempotent; never raises into the caller."""
    try:
        with _lock:
            if _state and _state.get("pid") == os.getpid():
                return True
            _state.clear()
            seconds = setting("PROBE_HANG_TIMEOUT")
            if seconds is None:
                return False
            path = os.path.join(runtime_dir(), f"hang-{os.getpid()}.txt")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            _state.update(pid=os.getpid(), timeout=seconds, path=path, file=os.fdopen(fd, "a"))
            _arm()
        boundary.heartbeat(_on_heartbeat)
        state.add_status_provider(status)
        return True
    except Exception as exc:
        record_error("hang watchdog", exc)
        return False


def uninstall() -> None:
    """Disarm the timer and close the dump file (the file itself stays for the user)."""
    with _lock:
        if not _state:
            return
        boundary.remove(_on_heartbeat)
        if _state.get("pid") == os.getpid():
            faulthandler.cancel_dump_traceback_later()
        try:
            _state["file"].close()
        except OSError:
            pass
        _state.clear()


def status() -> dict:
    """``state="hung"`` and ``hung_since`` (the last heartbeat: within a second of the last step, or the arming)
    once the timer has written stacks."""
    if not _state or _state.get("pid") != os.getpid():
        return {}
    try:
        st = os.stat(_state["path"])
    except OSError:
        return {}
    out = {"hang_timeout": _state["timeout"], "hang_dump": _state["path"]}
    if st.st_size > _state["armed_size"]:
        out.update(state="hung", hung_since=_state["beat_at"], hang_detected_at=st.st_mtime)
    return out


def _before_fork() -> None:
    # A child forked while the C timer runs inherits its lock held and hangs at exit
    # (faulthandler cannot cancel a thread that fork did not copy): disarm around fork.
    if _state and _state.get("pid") == os.getpid():
        faulthandler.cancel_dump_traceback_later()


def _after_fork_in_parent() -> None:
    if _state and _state.get("pid") == os.getpid():
        remaining = _state["timeout"] + LATE_S - (_clock() - _state["armed_mono"])
        faulthandler.dump_traceback_later(max(remaining, 0.001), repeat=False, file=_state["file"], exit=False)


def _after_fork_in_child() -> None:
    _state.clear()  # a DataLoader worker must not write the parent's dumps


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
