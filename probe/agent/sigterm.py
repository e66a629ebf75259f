"""SIGTERM: write the post-mortem record and remove this process's entry, then die of SIGTERM as
promptly as without the probe.

A Python-level signal handler runs only when the main thread comes back to the interpreter;
a rank waiting in C (a gloo ``all_reduce`` on a peer that never comes, ``Future.wait``) never
does, so a handler alone would keep the process alive until the launcher's SIGKILL. Two paths,
whichever comes first does the work once:

- the Python handler, on the main thread, when it is running Python (the stacks are where
  the signal found it);
- a watcher thread woken through ``signal.set_wakeup_fd`` (CPython's C-level handler writes
  the signal number to that pipe at once, on any thread, without the GIL), which writes the
  record from its own thread and then puts back the default action at the C level
  (``signal(SIGTERM, SIG_DFL)`` through libc) and raises SIGTERM again.

The record's writing is bounded (``postmortem.terminated``, ``_RECORD_WAIT``): the process is
gone within about a second whatever the record does. Left alone: a handler the program
installed itself, a wakeup fd someone else set (asyncio: then only the Python path), and a C
call that holds the GIL while it blocks (no Python thread can run then; torch's collectives and
waits release it).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from ..postmortem import hooks as postmortem
from ..util.errorlog import record_error

__all__ = ["install"]

_once = threading.Lock()  # taken by whichever path handles the signal first
_state: dict = {}


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


def _handle(frame, stop) -> bool:
    """Record and clean up, once per process; False when the other path already does."""
    if not _once.acquire(blocking=False):
        return False
    try:
        postmortem.terminated(signal.SIGTERM, frame)  # never raises; bounded wait
        stop(exiting=True)  # close the sockets, remove the registry entry: no thread joins on the way out
    except Exception as exc:
        record_error("SIGTERM: record and clean-up", exc)
    return True


def _watch(rfd: int, stop) -> None:
    """The watcher thread: block on the wakeup pipe (no polling), act on a SIGTERM byte."""
    while True:
        try:
            data = os.read(rfd, 64)
        except InterruptedError:
            continue
        except OSError:
            return  # closed: the probe stopped
        if not data:
            return
        if int(signal.SIGTERM) not in data:
            continue  # another signal with a Python handler (SIGINT): the main thread deals with it
        if signal.getsignal(signal.SIGTERM) is not _state.get("handler"):
            continue  # the program installed its own handler since (graceful preemption): its call, not ours
        main = sys._current_frames().get(threading.main_thread().ident)
        try:
            if _handle(main, stop):
                _die()
        except Exception as exc:
            record_error("SIGTERM: dying from the watcher thread", exc)
            os._exit(128 + int(signal.SIGTERM))  # never outlive a SIGTERM because the probe failed
        return


def install(stop) -> None:
    """Install the handler and the watcher (main thread, SIGTERM still at its default action); never raises.

    ``stop``: the probe's ``stop(exiting=...)``, called once before the process dies."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def on_term(signum, frame):
            if not _handle(frame, stop):
                return  # the watcher is writing the record and ends the process
            _die()

        signal.signal(signal.SIGTERM, on_term)
        _state["handler"] = on_term
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)  # set_wakeup_fd requires it; the reader blocks
        try:
            old = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        except (ValueError, OSError) as exc:
            os.close(rfd), os.close(wfd)
            record_error("SIGTERM: wakeup fd", exc)
            return
        if old != -1:  # someone else's (asyncio): give it back, keep the Python path only
            signal.set_wakeup_fd(old)
            os.close(rfd), os.close(wfd)
            return
        _state.update(rfd=rfd, wfd=wfd)
        threading.Thread(target=_watch, args=(rfd, stop), name="probe-sigterm", daemon=True).start()
    except (ValueError, OSError) as exc:
        record_error("SIGTERM handler", exc)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) must not write its signals into the parent's pipe."""
    wfd, rfd = _state.pop("wfd", None), _state.pop("rfd", None)
    _state.clear()
    if wfd is None:
        return
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass  # forked from a thread other than the main one: the parent's watcher may see the child's SIGTERM
    for fd in (rfd, wfd):
        try:
            os.close(fd)
        except OSError:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
