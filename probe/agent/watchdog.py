"""How a stuck or terminated process is still seen: the hang watchdog (all-thread stacks on disk when no step
completes for PROBE_HANG_TIMEOUT seconds) and the SIGTERM guard (a post-mortem record, then death as prompt as
without the probe). docs/postmortem.md tells what each covers and what it does not.

The hang watchdog uses ``faulthandler.dump_traceback_later``, whose timer is a C thread that writes
the stacks without taking the GIL, so it works even when the training thread is stuck inside a C
call with the GIL held. It is re-armed from a ``probe._core.boundary`` heartbeat, at most every
``REARM_S`` (re-arming restarts faulthandler's thread) and for ``S + LATE_S`` seconds, so a heartbeat's
lag never makes it fire early. Nothing polls: the dump is noticed, by one ``fstat``, when someone asks
for the status.

The SIGTERM guard writes the record and removes this process's entry, then dies of SIGTERM; why a
watcher thread woken through ``signal.set_wakeup_fd`` does it besides the Python handler is docs/postmortem.md's
"SIGTERM".

One ``Watchdog`` and one ``SigtermGuard`` belong to the running session (``probe.agent.lifecycle``), which
installs them, removes them and tells them about forks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time

from ..config import setting
from .._runtime import runtime_dir
from .._core.boundary import boundary
from ..postmortem import hooks as postmortem
from ..util.errorlog import record_error


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
        boundary.heartbeat(self._on_heartbeat)

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
        boundary.remove(self._on_heartbeat)
        faulthandler.cancel_dump_traceback_later()
        with contextlib.suppress(OSError):
            self.file.close()

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
        boundary.remove(self._on_heartbeat)


class SigtermGuard:
    """The SIGTERM handler and its watcher thread (see the module's docstring); ``stop`` is the probe's
    ``stop(exiting=...)``, called once before the process dies."""

    def __init__(self, stop):
        self.stop = stop
        self.once = threading.Lock()  # taken by whichever path handles the signal first
        self.rfd = self.wfd = self.thread = None

    @classmethod
    def install(cls, stop) -> SigtermGuard | None:
        """Install the handler and the watcher (main thread, SIGTERM still at its default action); never raises."""
        if threading.current_thread() is not threading.main_thread():
            return None
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return None
            self = cls(stop)
            signal.signal(signal.SIGTERM, self.on_term)
            rfd, wfd = os.pipe()
            os.set_blocking(wfd, False)  # set_wakeup_fd requires it; the reader blocks
            try:
                old = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
            except (ValueError, OSError) as exc:
                os.close(rfd), os.close(wfd)
                record_error("SIGTERM: wakeup fd", exc)
                return self
            if old != -1:  # someone else's (asyncio): give it back, keep the Python path only
                signal.set_wakeup_fd(old)
                os.close(rfd), os.close(wfd)
                return self
            self.rfd, self.wfd = rfd, wfd
            self.thread = threading.Thread(target=self._watch, name="probe-sigterm", daemon=True)
            self.thread.start()
            return self
        except (ValueError, OSError) as exc:
            record_error("SIGTERM handler", exc)
            return None

    def uninstall(self) -> None:
        """Put SIGTERM's default action and the wakeup fd back (where they are still ours) and end the watcher."""
        if signal.getsignal(signal.SIGTERM) == self.on_term and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.wfd is None:
            return
        try:
            if signal.set_wakeup_fd(-1) != self.wfd:
                signal.set_wakeup_fd(-1)  # never ours to take back: someone set theirs since (one can only swap)
        except ValueError:
            pass  # not the main thread: the fd stays set until the process ends, the watcher still stops
        try:
            os.write(self.wfd, b"\0")  # no signal is numbered 0: it tells the watcher to end
        except OSError:
            pass
        self.thread.join(2)
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self.rfd, self.wfd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.rfd = self.wfd = None

    def on_term(self, signum, frame) -> None:
        if self._handle(frame):
            _die()
        # else the watcher is writing the record and ends the process

    def _handle(self, frame) -> bool:
        """Record and clean up, once per process; False when the other path already does."""
        if not self.once.acquire(blocking=False):
            return False
        try:
            postmortem.terminated(signal.SIGTERM, frame)  # never raises; bounded wait
            self.stop(exiting=True)  # close the sockets, remove the registry entry: no thread joins on the way out
        except Exception as exc:
            record_error("SIGTERM: record and clean-up", exc)
        return True

    def _watch(self) -> None:
        """The watcher thread: block on the wakeup pipe (no polling), act on a SIGTERM byte."""
        while True:
            try:
                data = os.read(self.rfd, 64)
            except InterruptedError:
                continue
            except (OSError, TypeError):
                return  # closed: the probe stopped
            if not data or 0 in data:
                return
            if int(signal.SIGTERM) not in data:
                continue  # another signal with a Python handler (SIGINT): the main thread deals with it
            if signal.getsignal(signal.SIGTERM) != self.on_term:
                continue  # the program installed its own handler since (graceful preemption): its call, not ours
            main = sys._current_frames().get(threading.main_thread().ident)
            try:
                if self._handle(main):
                    _die()
            except Exception as exc:
                record_error("SIGTERM: dying from the watcher thread", exc)
                os._exit(128 + int(signal.SIGTERM))  # never outlive a SIGTERM because the probe failed
            return

    def after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker) must not write its signals into the parent's pipe."""
        if self.wfd is None:
            return
        try:
            signal.set_wakeup_fd(-1)
        except (ValueError, OSError):
            pass  # forked from a thread other than the main one: the parent's watcher may see the child's SIGTERM
        self._close_fds()


def _die() -> None:
    """Put SIGTERM's default action back and raise it: the process ends as the signal would have ended it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    else:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(int(signal.SIGTERM), None)  # SIG_DFL is the null handler
    os.kill(os.getpid(), signal.SIGTERM)
