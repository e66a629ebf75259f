"""Stopping the process groups that tests and benchmarks start (no pytest here: benchmarks import it too).

    sys.path.insert(0, str(ROOT / "tests")); from _procs import stop_groups
"""

from __future__ import annotations

import os
import signal
import subprocess

__all__ = ["stop_groups"]


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:  # already gone
        pass


def stop_groups(popens: list, grace: float = 10.0) -> None:
    """Stop each Popen's process group (started with ``start_new_session=True``): SIGCONT for the
    stopped ones, SIGTERM to every group first, then SIGKILL to the groups that outlive ``grace`` seconds."""
    live = [p for p in popens if p.poll() is None]
    for p in live:
        _signal_group(p.pid, signal.SIGCONT)
        _signal_group(p.pid, signal.SIGTERM)
    for p in live:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            _signal_group(p.pid, signal.SIGKILL)
            p.wait(5)
