"""Host-device syncs on traced steps: ``torch.syncs``, one row per call site and step.

On a CUDA job, the tracer turns torch's sync debug mode to "warn"
(``torch.cuda.set_sync_debug_mode``) for the steps it traces and back to "default"
after them. torch then raises the warning "called a synchronizing CUDA operation"
from every call that makes the host wait for the device (``.item()``, ``.cpu()``,
``.tolist()``, ``nonzero``, boolean-mask indexing, a ``print`` of a CUDA tensor...), in
the Python frame that made the call. While the watch is on, probe's own
``warnings.showwarning`` takes those warnings (nothing is printed), walks the stack out
to the first frame of the user's code (``probe.util.usercode``) and counts the call site.
Other warnings go to the previous ``showwarning`` untouched.

Why torch's detector rather than sampling the stack for ``.item()`` calls: it is the
ground truth of what synchronised (implicit syncs included), it costs nothing on steps
it is off, and it sees every sync of the traced step, not a sample. What it misses, as
torch documents: ``torch.cuda.synchronize()`` itself and syncs inside ``torch.distributed``.

One ``warnings`` filter ("always" for that message only) is added once per process (again
only if something removed it) so that repeated syncs at the same line are all counted (the
"default" action shows a warning once per line). A job that set its own sync debug mode is left alone (the watch
stays off).
On CPU there is nothing to synchronise with; the watch still takes the warning's path on
traced steps, so a warning of the same form (a test stand-in) is counted the same way.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import warnings

from ..util.usercode import user_frame
from ..util.errorlog import record_error
from ..util.ring import Ring

__all__ = ["SyncWatch", "SYNC_MESSAGE", "SYNC_COLUMNS"]

SYNC_MESSAGE = "called a synchronizing CUDA operation"
SYNC_COLUMNS = {
    "step": "i8",
    "time": "f8",
    "rank": "f8",
    "file": "O",
    "line": "i8",
    "function": "O",
    "code": "O",
    "count": "i8",
    "origin": "O",
    "via": "O",
}
_PROBE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_PATTERN = re.escape(SYNC_MESSAGE)


def _always_show_syncs() -> None:
    """Put the filter in front of the others, unless it is already there (a ``catch_warnings`` exit drops it)."""
    for f in warnings.filters:
        if f[0] == "always" and f[2] is UserWarning and getattr(f[1], "pattern", None) == _PATTERN:
            return
    warnings.filterwarnings("always", message=_PATTERN, category=UserWarning)


class SyncWatch:
    def __init__(self, torch, rank, capacity: int = 10000):
        self.torch = torch
        self.rank = rank
        self.ring = Ring(SYNC_COLUMNS, capacity)
        self.active = False
        self.sites: dict = {}  # (file, line, function, origin, via) -> [count, first seen (epoch)]
        self._thread = None
        self._previous = None  # the showwarning ours delegates to
        self._hook = self._showwarning  # one bound method, so it can be recognised
        self._mode_set = False

    def start(self, cuda: bool) -> None:
        """Turn the watch on (at the boundary before a traced step, on the training thread)."""
        if self.active:
            return
        try:
            if cuda and self.torch.cuda.get_sync_debug_mode() != 0:
                return  # the job asked for its own sync checks: its warnings, its business
            _always_show_syncs()
            self._thread = threading.get_ident()
            if warnings.showwarning is not self._hook:
                self._previous = warnings.showwarning
                warnings.showwarning = self._hook
            self.active = True
            if cuda:
                self.torch.cuda.set_sync_debug_mode(1)
                self._mode_set = True
        except Exception as exc:
            record_error("torch syncs: start", exc)

    def stop(self, step: int | None) -> None:
        """Turn the watch off and write the sites seen since ``start`` as rows of ``step`` (None: drop them)."""
        if not self.active:
            return
        self.active = False
        try:
            if self._mode_set:
                self._mode_set = False
                self.torch.cuda.set_sync_debug_mode(0)
            if warnings.showwarning is self._hook and self._previous is not None:
                warnings.showwarning, self._previous = self._previous, None
            sites, self.sites = self.sites, {}
            if step is not None:
                self.add_rows(step, sites)
        except Exception as exc:
            record_error("torch syncs: stop", exc)

    def add_rows(self, step: int, sites: dict) -> None:
        import linecache

        rank = float("nan") if self.rank is None else float(self.rank)
        for (file, line, function, origin, via), (count, first) in sites.items():
            code = linecache.getline(file, line).strip() or None
            self.ring.append(step, first, rank, file, line, function, code, count, origin, via)

    def _showwarning(self, message, category, filename, lineno, file=None, line=None):
        if not self.active or not str(message).startswith(SYNC_MESSAGE):
            previous = self._previous or warnings._showwarning_orig
            return previous(message, category, filename, lineno, file, line)
        if threading.get_ident() != self._thread:
            return None  # another thread (a query reading a tensor): synced only because the mode is on
        try:
            self.seen(sys._getframe(1), filename, lineno)
        except Exception as exc:
            record_error("torch syncs: recording a sync", exc)
        return None

    def seen(self, frame, filename: str, lineno: int) -> None:
        """Count one sync raised in ``frame`` (or an outer frame: the ``warnings`` module's own are skipped)."""
        while frame is not None and frame.f_globals.get("__name__") == "warnings":
            frame = frame.f_back
        inner = frame
        user = user_frame(frame)[0] or inner
        if user is None:
            return
        if inner is user:
            origin = "user"
        elif os.path.abspath(inner.f_code.co_filename).startswith(_PROBE_DIR):
            origin = "probe"
        else:
            origin = "library"
        key = (user.f_code.co_filename, user.f_lineno, user.f_code.co_name, origin, f"{filename}:{lineno}")
        hit = self.sites.get(key)
        if hit is None:
            self.sites[key] = [1, time.time()]
        else:
            hit[0] += 1
