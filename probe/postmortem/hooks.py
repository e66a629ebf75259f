"""When to write a post-mortem record: uncaught exceptions, fatal signals, exit, and periodically.

``install()`` (called when the probe starts) chains ``sys.excepthook`` and
``threading.excepthook`` (the previous hooks still run: the user sees the traceback as
always), points faulthandler's fatal-signal dump at ``fatal-<pid>.txt`` in the runtime
directory when the user has not enabled faulthandler already, wraps ``sys.exit`` (for the
code of ``sys.exit(N)`` in the ``exit`` record that ``at_exit`` writes), and starts
the periodic snapshot thread. ``terminated()`` is the SIGTERM handler's first act (the
agent's lifecycle calls it before it stops the probe). Every one of these is best effort:
a failure is recorded in probe.errors and the process goes on (or dies of its own error).

The periodic snapshot (docs/postmortem.md) rewrites the record with cause ``snapshot`` off the
training thread, so a process killed with SIGKILL still leaves its last minute.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

from ..config import setting
from .._runtime import runtime_dir
from ..util.errorlog import record_error
from . import record
from .retention import prune


_state: dict = {}
_stop = threading.Event()
_prev_exit = sys.exit  # what our sys.exit wrapper calls (the one it replaced)
_TERM_WAIT = 1.0  # seconds a SIGTERM waits for its record before the process dies anyway (<= 2 s in all)


def fatal_path(pid: int) -> str:
    return os.path.join(runtime_dir(create=False), f"fatal-{pid}.txt")


def _excepthook(exc_type, exc, tb):
    if issubclass(exc_type, KeyboardInterrupt):
        _state["died"] = True
        record.write("interrupted", exc.with_traceback(tb) if exc is not None else None)
    elif not issubclass(exc_type, SystemExit):
        _state["died"] = True
        record.write("exception", exc.with_traceback(tb) if exc is not None else None)
    (_state.get("sys_hook") or sys.__excepthook__)(exc_type, exc, tb)


def _thread_hook(args):
    if args.exc_type is not SystemExit:
        record.write("thread_exception", args.exc_value, thread=getattr(args.thread, "name", None))
    (_state.get("thread_hook") or threading.__excepthook__)(args)


def _sys_exit(status=None, /):
    """``sys.exit`` that remembers its status for the exit record, then exits as before.

    Only the main thread's call counts (elsewhere sys.exit ends one thread, not the
    process); ``at_exit`` trusts it only when no step completed since (a caught
    SystemExit in a loop that goes on). ``raise SystemExit(N)`` is not seen: its record
    says "exited normally".
    """
    try:
        if threading.current_thread() is threading.main_thread():
            from .._core.boundary import boundary

            _state["exit"] = (status, boundary.last_step)
    except Exception:
        pass
    _prev_exit(status)


def _exit_status() -> tuple:
    """``(code, detail)`` of the main thread's last ``sys.exit`` when it ended the process, else ``(None, None)``."""
    from .._core.boundary import boundary

    found = _state.get("exit")
    if not found or found[1] != boundary.last_step:
        return None, None
    status = found[0]
    if status is None or isinstance(status, int):
        return int(status or 0), None
    return 1, repr(status)[:200]  # Python prints it and exits with 1


def at_exit() -> None:
    """The exit record, at normal interpreter exit (the session's exit hook calls it first)."""
    if _state.get("pid") == os.getpid() and not _state.get("died"):
        _stop.set()
        code, detail = _exit_status()
        record.write("exit", exit_code=code, detail=detail)


def terminated(signum: int, frame) -> None:
    """A SIGTERM handler's first act, before anything uninstalls the hooks: a ``terminated`` record with
    every thread's stack at that moment (the main thread's from ``frame``, where the signal found it).

    The record is written by a helper thread and waited for at most ``_TERM_WAIT`` seconds: the main
    thread may hold a lock the tables need (the signal can arrive inside a ring's append), and the
    process must still die. Never raises.
    """
    try:
        if _state.get("pid") != os.getpid() or _state.get("died"):
            return
        _state["died"] = True
        _stop.set()
        t = threading.Thread(
            target=record.write,
            args=("terminated",),
            kwargs={"detail": signal.Signals(signum).name, "frame": frame},
            name="probe-postmortem-term",
            daemon=True,
        )
        t.start()
        t.join(_TERM_WAIT)
    except Exception as exc:
        record_error("post-mortem record on SIGTERM", exc)


def _prune() -> None:
    """Bound the records and faulthandler dumps left by earlier processes (SIGKILL writes nothing)."""
    try:
        prune(record.records_dir(), setting("PROBE_POSTMORTEM_KEEP"), fatal_dir=runtime_dir(create=False))
    except Exception as exc:
        record_error("post-mortem pruning", exc)


def _snapshots(every: float) -> None:
    from .._core.boundary import boundary

    _prune()  # here, off the training thread
    last = None
    while not _stop.wait(every):
        step = boundary.last_step
        if step is None or step == last:
            continue  # nothing new: an idle process costs nothing
        last = step
        record.write("snapshot")


def install() -> None:
    """Idempotent; never raises into the caller."""
    try:
        if _state.get("pid") == os.getpid():
            return
        _state.clear()
        _state["pid"] = os.getpid()
        _stop.clear()
        if sys.excepthook is not _excepthook:
            _state["sys_hook"] = sys.excepthook
            sys.excepthook = _excepthook
        if threading.excepthook is not _thread_hook:
            _state["thread_hook"] = threading.excepthook
            threading.excepthook = _thread_hook
        if not faulthandler.is_enabled():
            fd = os.open(fatal_path(os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            _state["fatal_file"] = os.fdopen(fd, "w")
            faulthandler.enable(file=_state["fatal_file"], all_threads=True)
        if sys.exit is not _sys_exit and threading.current_thread() is threading.main_thread():
            global _prev_exit
            _prev_exit = sys.exit
            sys.exit = _sys_exit
        every = setting("PROBE_POSTMORTEM_EVERY")
        if every:
            t = threading.Thread(target=_snapshots, args=(every,), name="probe-postmortem", daemon=True)
            t.start()
            _state["thread"] = t
        else:
            _prune()
    except Exception as exc:
        record_error("post-mortem hooks", exc)


def uninstall() -> None:
    """Put the previous hooks back and stop the snapshot thread (probe.stop())."""
    _stop.set()
    thread = _state.get("thread")
    if thread is not None and thread is not threading.current_thread():
        thread.join(2)  # it ends at once unless a snapshot is being written
    if sys.excepthook is _excepthook:
        sys.excepthook = _state.get("sys_hook") or sys.__excepthook__
    if threading.excepthook is _thread_hook:
        threading.excepthook = _state.get("thread_hook") or threading.__excepthook__
    if sys.exit is _sys_exit:
        sys.exit = _prev_exit
    f = _state.pop("fatal_file", None)
    if f is not None:
        faulthandler.disable()
        f.close()
        try:
            os.unlink(fatal_path(os.getpid()))  # no death to report: the process stopped probing
        except OSError:
            pass
    _state.clear()


def _after_fork_in_child() -> None:
    _state.clear()  # a DataLoader worker is not the process the record describes
    record._thread_deaths.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
