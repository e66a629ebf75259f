"""python.backtrace and python.threads: where every thread of this process is."""

from __future__ import annotations

import linecache
import os
import sys
import threading

from .._tables import Column, table

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _threads_by_ident() -> dict:
    return {t.ident: t for t in threading.enumerate()}


def walk_stacks(exclude: frozenset = frozenset()):
    """Yield (thread_ident, thread, [frames innermost first]) for every thread but ``exclude``."""
    threads = _threads_by_ident()
    main_ident = threading.main_thread().ident
    for ident, frame in sys._current_frames().items():
        if ident in exclude:
            continue
        frames = []
        f = frame
        while f is not None:
            frames.append(f)
            f = f.f_back
        yield ident, threads.get(ident), ident == main_ident, frames


def frame_row(frame) -> tuple:
    code = frame.f_code
    lineno = frame.f_lineno or code.co_firstlineno
    line = linecache.getline(code.co_filename, lineno).strip() or None
    return code.co_name, code.co_filename, lineno, line


@table(
    "python.backtrace",
    "One row per frame of every Python thread, innermost frame first (depth 0).",
    columns=[
        Column("thread_id", "BIGINT", "threading ident of the thread."),
        Column("thread_name", "VARCHAR", "threading.Thread name, or NULL for a thread not started by threading."),
        Column("is_main", "BOOLEAN", "Whether the frame belongs to the main thread."),
        Column("depth", "INTEGER", "Frame position: 0 is the innermost (currently executing) frame."),
        Column("func", "VARCHAR", "Function name of the frame."),
        Column("file", "VARCHAR", "Source file of the frame."),
        Column("lineno", "INTEGER", "Line being executed in that file."),
        Column("line", "VARCHAR", "Source text of that line, when the file is readable."),
    ],
    examples=[
        "SELECT func, file, lineno, depth FROM python.backtrace ORDER BY depth LIMIT 10",
        "SELECT thread_name, func, lineno FROM python.backtrace WHERE is_main AND depth = 0",
    ],
)
def backtrace(ctx):
    rows = []
    for ident, thread, is_main, frames in walk_stacks(ctx.exclude_threads):
        name = thread.name if thread else None
        for depth, frame in enumerate(frames):
            rows.append((ident, name, is_main, depth, *frame_row(frame)))
    return rows


def _task_stat(native_id) -> tuple:
    """(state letter, user seconds, system seconds) from /proc, or Nones off Linux."""
    if native_id is None:
        return None, None, None
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            data = f.read()
        fields = data[data.rindex(")") + 2:].split()
        return fields[0], int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK
    except (OSError, ValueError, IndexError):
        return None, None, None


_STATES = {"R": "running", "S": "sleeping", "D": "disk-wait", "Z": "zombie", "T": "stopped", "t": "traced",
           "I": "idle", "X": "dead"}


@table(
    "python.threads",
    "Python threads of this process with their OS state, CPU time and current line.",
    columns=[
        Column("thread_id", "BIGINT", "threading ident of the thread."),
        Column("native_id", "BIGINT", "OS thread id (the TID shown by top and py-spy)."),
        Column("name", "VARCHAR", "threading.Thread name."),
        Column("daemon", "BOOLEAN", "Whether the thread is a daemon."),
        Column("alive", "BOOLEAN", "Whether the thread is alive."),
        Column("is_main", "BOOLEAN", "Whether this is the main thread."),
        Column("state", "VARCHAR", "OS scheduler state from /proc: running, sleeping, disk-wait, stopped, zombie."),
        Column("cpu_user_s", "DOUBLE", "User CPU seconds used by the thread."),
        Column("cpu_system_s", "DOUBLE", "System CPU seconds used by the thread."),
        Column("func", "VARCHAR", "Function the thread is executing now."),
        Column("file", "VARCHAR", "Source file of that function."),
        Column("lineno", "INTEGER", "Line being executed."),
    ],
    examples=[
        "SELECT name FROM python.threads WHERE NOT daemon",
        "SELECT name, state, cpu_user_s, func, lineno FROM python.threads ORDER BY cpu_user_s DESC",
    ],
)
def threads(ctx):
    frames = sys._current_frames()
    main = threading.main_thread()
    rows = []
    for t in threading.enumerate():
        if t.ident in ctx.exclude_threads:
            continue
        native = getattr(t, "native_id", None)
        state, utime, stime = _task_stat(native)
        frame = frames.get(t.ident)
        func, file, lineno, _ = frame_row(frame) if frame is not None else (None, None, None, None)
        rows.append((t.ident, native, t.name, t.daemon, t.is_alive(), t is main, _STATES.get(state, state),
                     utime, stime, func, file, lineno))
    return rows
