"""What the read routes may take from the training process: per listener, slots and a share of wall time.

Snapshots, backtraces and profiles are served on the server's threads, which compete with the
training thread for the GIL. Each listener (the owner's unix socket, and TCP when asked) has
its own ``Lane``: at most ``PROBE_MAX_SNAPSHOTS`` snapshots or backtraces at once (the rest
wait in line, up to their timeout), and ``PROBE_SERVE_SHARE`` of wall time, averaged over
``PACE_WINDOW_S`` seconds: each request is charged the CPU time of its thread in full
(parsing, generating every table, walking stacks, encoding), however large, and the next one
waits until that debt is earned back (an occasional request never waits; a client whose
requests cost a lot waits long, and so do twenty clients asking back to back; one whose timeout
ends first is refused after half of it, so that asking again at once buys nothing). A profile is
charged as it samples and slows down when its lane is in debt. Two lanes, two budgets: TCP
clients holding the token can spend TCP's share and slots, never the owner's, so the process
gives its readers at most twice the share.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager

from .._errors import ProbeError
from ..config import setting
from ..util.budget import Budget

__all__ = ["BusyError", "Lane", "lane", "served"]

PACE_WINDOW_S = 10.0  # PROBE_SERVE_SHARE is kept over this window (its share of it is the credit a lane starts with)


class BusyError(ProbeError):
    """A request could not be served within its timeout: its lane's share or slots were spent (HTTP 503)."""

    kind = "busy"
    exit_code = 3


class Lane:
    """One listener's slots and pace, made at first use (the settings are read then)."""

    def __init__(self, name: str):
        self.name = name
        self.lock = threading.Lock()
        self.profiling = threading.Lock()  # one profile at a time per lane
        self._slots: threading.BoundedSemaphore | None = None
        self._pace: Budget | None = None  # under ``lock``
        self._pace_at = 0  # when it last earned (time.monotonic_ns())

    def _bucket(self) -> Budget:
        """The pace's bucket, brought up to now (under ``lock``)."""
        now = time.monotonic_ns()
        if self._pace is None:
            # every cost charged in full (no cap on one charge nor on the debt): a client chooses what its
            # request costs (heavy filter trees over every table, a backtrace of every thread), so a cap
            # would be its discount
            self._pace = Budget(
                setting("PROBE_SERVE_SHARE"), burst_s=PACE_WINDOW_S, charge_cap=math.inf, debt_cap=math.inf
            )
        else:
            self._pace.earn(now - self._pace_at)
        self._pace_at = now
        return self._pace

    def wait_s(self) -> float:
        """Seconds until the lane's share has credit again (0 when it has)."""
        with self.lock:
            return self._bucket().wait_ns() / 1e9

    def paced(self, timeout: float, what: str = "request") -> None:
        """Wait until the lane's share has credit again; BusyError when that would take over ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            wait = self.wait_s()
            if wait <= 0:
                return
            if time.monotonic() + wait > deadline:
                # wait half the timeout before refusing (a client's own timeout ends with the other half): a client
                # that asks again at once after each refusal then costs the process one request per half timeout
                time.sleep(max(0.0, min(deadline - time.monotonic(), timeout / 2)))  # ok-sleep: waits in line
                raise BusyError(
                    f"the probe is pacing its readers: their {what}s may take {self._pace.share * 100:g} % of the "
                    f"training process's time (PROBE_SERVE_SHARE) and this one could not start within {timeout:g} s; "
                    "retry, ask less often, or raise PROBE_SERVE_SHARE in the training process."
                )
            time.sleep(min(wait, 0.25))  # ok-sleep: waiting for the share to refill

    def charge(self, cpu_ns: float) -> None:
        with self.lock:
            self._bucket().spend(cpu_ns)

    @contextmanager
    def slot(self, timeout: float):
        """One of the lane's ``PROBE_MAX_SNAPSHOTS`` slots, waited for up to ``timeout``; BusyError after."""
        with self.lock:
            if self._slots is None:
                self._slots = threading.BoundedSemaphore(setting("PROBE_MAX_SNAPSHOTS"))
            slots = self._slots
        if not slots.acquire(timeout=timeout):
            raise BusyError(
                f"the probe is busy: {setting('PROBE_MAX_SNAPSHOTS')} snapshots were running and this one waited "
                f"{timeout:g} s in line; retry, or raise PROBE_MAX_SNAPSHOTS in the training process."
            )
        try:
            yield
        finally:
            slots.release()


_LANES = {"unix": Lane("unix"), "tcp": Lane("tcp")}


def lane(transport: str | None) -> Lane:
    """The lane of a listener: the owner's unix socket, or TCP (anything that is not the unix socket)."""
    return _LANES["unix" if transport == "unix" else "tcp"]


@contextmanager
def served(transport: str | None, timeout: float, what: str = "request"):
    """Serve one request on ``transport``'s lane: wait for its share and a slot (BusyError past ``timeout``),
    then charge the request's whole cost, answered or refused. The server runs one thread per request,
    so its thread's CPU time is what it cost (reading and parsing the body included)."""
    ln = lane(transport)
    try:
        ln.paced(timeout, what)
        with ln.slot(timeout):
            yield ln
    finally:
        ln.charge(time.thread_time_ns())
