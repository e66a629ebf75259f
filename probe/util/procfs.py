"""What /proc says about a process: resident memory and scheduler state (Linux; None elsewhere)."""

from __future__ import annotations

import os

__all__ = ["rss_bytes", "RssReader", "proc_state"]

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


def proc_state(pid: int | None) -> str | None:
    """The kernel's one-letter state of a local pid (R, S, D, T stopped, Z), or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
