"""What /proc says about a process: resident memory, scheduler state and its threads' ids (Linux; None elsewhere)."""

from __future__ import annotations

import os
import threading


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident(statm: bytes | str) -> int:
    return int(statm.split()[1]) * _PAGE


def rss_bytes() -> int | None:
    """Resident memory of this process in bytes, or None when /proc cannot tell."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return _resident(f.read())
    except (OSError, ValueError, IndexError):
        return None


class RssReader:
    """Resident memory read many times a second (module tracing): the file stays open, one pread per call."""

    def __init__(self):
        try:
            self.fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self.fd = None

    def __call__(self) -> float:
        if self.fd is None:
            return float("nan")
        try:
            return float(_resident(os.pread(self.fd, 128, 0)))
        except (OSError, ValueError, IndexError):
            return float("nan")


class RunDelayReader:
    """Nanoseconds the calling thread has waited, runnable, for a CPU (schedstat's run_delay).

    The kernel counts it per thread; a rise means the host's other work (other processes, data
    loader workers, a neighbour's job) kept this thread off the CPU. The file is opened by the
    first call on a thread and read with one pread per call; another thread reopens it.
    """

    def __init__(self):
        self.fd = None
        self.thread = None

    def __call__(self) -> int | None:
        import threading

        try:
            if self.thread != threading.get_ident():
                if self.fd is not None:
                    os.close(self.fd)
                self.fd, self.thread = None, threading.get_ident()
                self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            if self.fd is None:
                return None
            return int(os.pread(self.fd, 96, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return None


def proc_state(pid: int | None) -> str | None:
    """The kernel's one-letter state of a local pid (R, S, D, T stopped, Z), or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def proc_start(pid: int | str = "self") -> int | None:
    """When process ``pid`` started, in clock ticks since boot (/proc's ``starttime``), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def start_time(ticks: int) -> float | None:
    """A ``proc_start`` value as seconds since the epoch (the boot time from /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return None


class CpuWait:
    """Seconds a thread waited for a CPU per step, on average between two calls on it (``RunDelayReader``)."""

    def __init__(self):
        self.read = RunDelayReader()
        self.last = None  # (run_delay ns, step) at the last call

    def per_step(self, step: int) -> float | None:
        """The wait per step since the last call (None on the first, or where schedstat is missing)."""
        ns = self.read()
        last, self.last = self.last, (None if ns is None else (ns, step))
        if ns is None or last is None or step <= last[1]:
            return None
        return (ns - last[0]) * 1e-9 / (step - last[1])


def native_id(thread) -> int | None:
    """``thread``'s OS thread id (the TID of /proc/self/task, top and py-spy). In a process started by fork
    (a rank started with ``start_method="fork"``, Lightning's ``ddp_fork``), CPython 3.11-3.13 keep the
    parent's id on ``threading.main_thread()``, another process's thread: the main thread's id is then this
    process's id, as on Linux the thread that forked is the child's first thread."""
    native = getattr(thread, "native_id", None)
    inherited = native is not None and native != os.getpid() and thread is threading.main_thread()
    if inherited and not os.path.exists(f"/proc/self/task/{native}"):
        return os.getpid()
    return native


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs here; a zombie (exited, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return proc_state(pid) != "Z"
