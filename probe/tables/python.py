"""python.backtrace and python.threads: where every thread of this process is; python.spans: the named spans
user code records with ``probe.span``.
"""

from __future__ import annotations

import linecache
import os
import sys
import threading
import time

from ..util.procfs import native_id
from .registry import Column, ring_rows, table
from .._core import spans


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


_SLICE = 16  # threads walked between two releases of the GIL (the training thread takes it meanwhile)


def thread_roots(exclude: frozenset = frozenset()) -> list:
    """(thread_ident, thread, is_main, innermost frame) of every thread but ``exclude``."""
    threads = {t.ident: t for t in threading.enumerate()}
    main_ident = threading.main_thread().ident
    return [
        (ident, threads.get(ident), ident == main_ident, frame)
        for ident, frame in sys._current_frames().items()
        if ident not in exclude
    ]


def walk_stacks(exclude: frozenset = frozenset()):
    """Yield (thread_ident, thread, is_main, [frames innermost first]) for every thread but ``exclude``, letting
    the GIL go every few threads."""
    for i, (ident, thread, is_main, frame) in enumerate(thread_roots(exclude)):
        if i and i % _SLICE == 0:
            time.sleep(0)  # ok-sleep: lets the training thread have the GIL between threads
        frames = []
        f = frame
        while f is not None:
            frames.append(f)
            f = f.f_back
        yield ident, thread, is_main, frames


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
        Column(
            "is_native",
            "BOOLEAN",
            "True for a C/C++ frame. The process sees only its Python frames (false); "
            "`probe PID query --native` reads the native ones with py-spy on the process's host.",
        ),
    ],
    examples=[
        "SELECT func, file, lineno, depth FROM python.backtrace ORDER BY depth LIMIT 10",
        "SELECT thread_name, func, lineno FROM python.backtrace WHERE is_main AND depth = 0",
        "SELECT depth, func, file FROM python.backtrace WHERE is_main AND is_native  -- with query --native",
    ],
)
def backtrace(ctx):
    rows = []
    for ident, thread, is_main, frames in walk_stacks(ctx.exclude_threads):
        name = thread.name if thread else None
        for depth, frame in enumerate(frames):
            rows.append((ident, name, is_main, depth, *frame_row(frame), False))
    return rows


def thread_state(thread) -> str | None:
    """The OS scheduler state of ``thread`` (running, sleeping, disk-wait, ...), or None off Linux."""
    state = _task_stat(native_id(thread))[0]
    return _STATES.get(state, state)


def _task_stat(native_id) -> tuple:
    """(state letter, user seconds, system seconds) from /proc, or Nones off Linux."""
    if native_id is None:
        return None, None, None
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            data = f.read()
        fields = data[data.rindex(")") + 2 :].split()
        return fields[0], int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK
    except (OSError, ValueError, IndexError):
        return None, None, None


_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "disk-wait",
    "Z": "zombie",
    "T": "stopped",
    "t": "traced",
    "I": "idle",
    "X": "dead",
}


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
        Column(
            "executing",
            "BOOLEAN",
            "Whether the thread ran Python bytecode during a 50 ms window of this query (its instruction moved, or it "
            "used CPU while the GIL was busy); false means it sits in one C call, sleep, lock or I/O.",
        ),
        Column(
            "unchanged_s",
            "DOUBLE",
            "Seconds the thread has shown no progress (same Python instruction, no wake-up from a wait) in probe's "
            "samples, which are taken only when this table is queried; 0 while executing.",
        ),
    ],
    examples=[
        "SELECT name FROM python.threads WHERE NOT daemon",
        "SELECT name, state, cpu_user_s, func, lineno FROM python.threads ORDER BY cpu_user_s DESC",
        "SELECT name, executing, unchanged_s, state, func, lineno FROM python.threads WHERE is_main",
    ],
)
def threads(ctx):
    live = [t for t in threading.enumerate() if t.ident not in ctx.exclude_threads]
    before = _positions(ctx.exclude_threads)
    cpu_before = {t.ident: _cpu_ns(native_id(t)) for t in live}
    gil_busy = _gil_busy(_LIVENESS_WINDOW_S)
    frames = sys._current_frames()
    now = time.time()
    main = threading.main_thread()
    rows = []
    for t in threading.enumerate():
        if t.ident in ctx.exclude_threads:
            continue
        native = native_id(t)
        state, utime, stime = _task_stat(native)
        frame = frames.get(t.ident)
        func, file, lineno, _ = frame_row(frame) if frame is not None else (None, None, None, None)
        cpu_share = _share(cpu_before.get(t.ident), _cpu_ns(native))
        # a spin at one instruction offset: the GIL stayed busy and the thread ran at all (1 ms in the window; a
        # share such as 20 % reads a spinning thread on a loaded host, which gets a few ms in 50, as stopped)
        moved = before.get(t.ident) != _position(frame) or (gil_busy and cpu_share > _SPIN_SHARE)
        executing, unchanged = _liveness(t.ident, moved, _position(frame), _wakeups(native), now)
        rows.append(
            (
                t.ident,
                native,
                t.name,
                t.daemon,
                t.is_alive(),
                t is main,
                _STATES.get(state, state),
                utime,
                stime,
                func,
                file,
                lineno,
                executing,
                unchanged,
            )
        )
    for ident in set(_last_change) - set(frames):
        del _last_change[ident]  # threads that ended
    return rows


# Liveness without a hot-path cost: two samples of each thread's position (innermost frame,
# its instruction offset, stack depth) taken by the query itself, plus, across queries, the
# time each thread was first seen at its current position with its current count of
# wake-ups (voluntary context switches), so a loop around a short sleep counts as progress.
_LIVENESS_WINDOW_S = 0.05
_SPIN_SHARE = 0.02  # CPU share of the window above which a thread that kept the GIL busy counts as executing
_last_change: dict = {}  # thread ident -> (position, time it was first seen there)


def _position(frame) -> tuple | None:
    if frame is None:
        return None
    depth, f = 0, frame
    while f is not None:
        depth, f = depth + 1, f.f_back
    return id(frame), id(frame.f_code), frame.f_lasti, depth


def _positions(exclude) -> dict:
    return {ident: _position(f) for ident, f in sys._current_frames().items() if ident not in exclude}


def _wakeups(native_id) -> int | None:
    """Voluntary context switches of a thread: it grows each time the thread blocks and wakes up."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _cpu_ns(native_id) -> int | None:
    """Nanoseconds a thread has run on a CPU (/proc schedstat), finer than the clock ticks of stat."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _share(before, after) -> float:
    if before is None or after is None:
        return 0.0
    return (after - before) / (_LIVENESS_WINDOW_S * 1e9)


def _gil_busy(window: float) -> bool:
    """Whether some thread keeps the GIL busy running bytecode during ``window`` seconds.

    Each short sleep releases the GIL; getting it back waits for the holder's next
    switch point (up to sys.getswitchinterval()) only while another thread is running
    bytecode. A loop can spin at the same instruction offset (where it yields the GIL),
    so this, with the thread's CPU time, catches what position sampling cannot.
    """
    late = []
    end = time.perf_counter() + window
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        time.sleep(0.002)  # ok-sleep: releases the GIL on purpose
        late.append(time.perf_counter() - t0 - 0.002)
    late.sort()
    return bool(late) and late[len(late) // 2] > min(0.001, sys.getswitchinterval() / 4)


def _liveness(ident, executing, after, wakeups, now: float) -> tuple:
    """(executing, unchanged_s) of one thread, given whether it executed bytecode during the window."""
    if after is None:
        return None, None
    key = (after, wakeups)
    seen = _last_change.get(ident)
    if executing:
        since = now
    elif seen is not None and seen[0] == key:
        since = seen[1]
    else:
        since = now - _LIVENESS_WINDOW_S
    _last_change[ident] = (key, since)
    return executing, now - since


@table(
    "python.spans",
    "Named spans recorded by user code with `with probe.span(name):` or `@probe.span(name)`, oldest first.",
    columns=[
        Column("name", "VARCHAR", "The span's name, as given to probe.span."),
        Column("step", "BIGINT", "The training step in progress when the span started (1 before the first step ends)."),
        Column("time", "TIMESTAMP", "When the span started."),
        Column("duration", "DOUBLE", "Wall-clock seconds the span lasted."),
        Column("depth", "INTEGER", "Nesting depth on its thread: 0 for an outermost span."),
        Column("parent", "VARCHAR", "Name of the enclosing span on the same thread, NULL for an outermost span."),
        Column("thread_id", "BIGINT", "threading ident of the thread that ran it."),
        Column("thread", "VARCHAR", "Name of that thread."),
        Column("rank", "INTEGER", "Global rank, NULL outside a distributed job."),
    ],
    examples=[
        "SELECT name, COUNT(*) AS n, AVG(duration) AS avg_s, SUM(duration) AS total_s FROM python.spans GROUP BY name "
        "ORDER BY total_s DESC",
        "SELECT s.step, SUM(s.duration) / ANY_VALUE(t.duration) AS data_share FROM python.spans s "
        "JOIN torch.steps t USING (step) WHERE s.name = 'data' GROUP BY s.step ORDER BY s.step DESC LIMIT 10",
    ],
    kind="ring",
)
def spans_table(ctx):
    return ring_rows(spans.ring(), spans.SPAN_COLUMNS, lambda r: r.snapshot())
