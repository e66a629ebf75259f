"""What a traced step writes at the boundary after it: its ``python.torch_trace`` rows, and ``torch.syncs``.

The tracer's hooks append bare tuples during the step (the module object, perf_counter times, memory, depth, CUDA
events); at the boundary after it, ``step_records`` names each call's module (its dotted path in the model the
object finder found, and that model's name) and puts the forward, backward and recomputation calls in time order,
and ``columns`` lays them out as the ring's numpy columns. Values read from the device later (CUDA durations, output
statistics) are written into the ring once they have landed (``landed_*``).

Host-device syncs (``torch.syncs``). On a CUDA job the tracer turns torch's sync debug mode to "warn" for the steps
it traces, and torch then warns "called a synchronizing CUDA operation" from every call that makes the host wait for
the device (``.item()``, ``.cpu()``, ``nonzero``, boolean-mask indexing, ...). While the watch is on, probe's own
``warnings.showwarning`` takes those warnings (nothing is printed), walks out to the first frame of the user's code
and counts the call site; other warnings go to the previous ``showwarning``. torch's detector is the ground truth of
what synchronised, costs nothing on steps it is off, and sees every sync of the traced step; it misses
``torch.cuda.synchronize()`` itself and syncs inside ``torch.distributed``. One ``warnings`` filter ("always" for
that message) makes repeated syncs at one line all count. A job that set its own sync debug mode is left alone. On
CPU the watch still takes the warning's path, so a warning of the same form is counted the same way.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import warnings
import weakref

from . import finder
from ..util.errorlog import record_error
from ..util.ring import Ring
from ..util.usercode import user_frame


# -- a traced step's rows ----------------------------------------------------------------------------
class ModuleNames:
    """``name_of(module)``: ``(dotted path, model name)`` of a module of a found model, else its class
    name and ''. Kept by object id with a weakref check, so a module that is gone is never named."""

    def __init__(self):
        self._names: dict = {}

    def name_of(self, module) -> tuple[str, str]:
        key = id(module)
        hit = self._names.get(key)
        if hit is not None and hit[0]() is module:
            return hit[1], hit[2]
        for root_name, root, _, _ in finder.known("model"):
            if root is module:
                self._names[key] = (weakref.ref(module), root_name, root_name)
                return root_name, root_name
            for name, sub in root.named_modules():
                try:
                    self._names[id(sub)] = (weakref.ref(sub), finder.module_path(name) or root_name, root_name)
                except TypeError:
                    pass
            hit = self._names.get(key)
            if hit is not None and hit[0]() is module:
                return hit[1], hit[2]
        name = type(module).__name__
        try:
            self._names[key] = (weakref.ref(module), name, "")
        except TypeError:
            pass
        return name, ""


def step_records(rows, out, back, again, name_of) -> list:
    """One traced step's calls in time order: ``(t0, module, model, cls, stage, t1, mem, depth, ev0, ev1,
    output statistics)``, from the forward ``rows`` (with their statistics ``out``), the backward cuts
    ``back`` and the recomputations ``again`` (which take the depth their module had in the forward)."""
    records = []
    for r, st in zip(rows, out):  # (module, t0, t1, mem, depth) on CPU, plus (ev0, ev1) on CUDA
        m = r[0]
        name, model = name_of(m)
        evs = r[5:] if len(r) > 5 else (None, None)
        records.append((r[1], name, model, type(m).__name__, "forward", r[2], r[3], r[4], *evs, st))
    for m, t0, t1, memv, ev0, ev1 in back:
        name, model = name_of(m)
        records.append((t0, name, model, type(m).__name__, "backward", t1, memv, 0, ev0, ev1, None))
    if again:
        depth_of = {}
        for r in rows:
            depth_of.setdefault(id(r[0]), r[4])
        for r in again:  # (module, t0, t1, mem) on CPU, plus (ev0, ev1) on CUDA
            m = r[0]
            name, model = name_of(m)
            evs = r[4:] if len(r) > 4 else (None, None)
            records.append(
                (
                    r[1],
                    name,
                    model,
                    type(m).__name__,
                    "recompute",
                    r[2],
                    r[3],
                    depth_of.get(id(m), name.count(".") + 1 if model else 0),
                    *evs,
                    None,
                )
            )
    records.sort(key=lambda r: r[0])
    return records


def columns(records: list, step: int, wall_offset: float, rank, cuda: bool = False) -> dict:
    """The ring's columns of ``records`` (output statistics aside); on CUDA the durations are device time,
    NULL until their events complete (``landed_durations``)."""
    import numpy as np

    n = len(records)
    t0 = np.fromiter((r[0] for r in records), "f8", n)
    t1 = np.fromiter((r[5] for r in records), "f8", n)
    memv = np.fromiter((r[6] for r in records), "f8", n)
    peak = np.fmax.accumulate(memv) if n else memv
    cols = {
        "step": np.full(n, step, "i8"),
        "seq": np.arange(n, dtype="i8"),
        "module": np.array([r[1] for r in records], dtype=object),
        "stage": np.array([r[4] for r in records], dtype=object),
        "duration": t1 - t0,
        "allocated": memv,
        "max_allocated": peak,
        "time": t0 + wall_offset,
        "rank": np.full(n, np.nan if rank is None else rank, "f8"),
        "depth": np.fromiter((r[7] for r in records), "i8", n),
        "model": np.array([r[2] for r in records], dtype=object),
        "module_type": np.array([r[3] for r in records], dtype=object),
    }
    if cuda:
        cols["duration"] = np.ma.masked_all(n)
    return cols


def landed_durations(ring, pending: list, pool: list) -> list:
    """Write the CUDA durations of ``pending`` (``(row, start event, end event)``) whose events have
    completed into ``ring``; returns those still waiting. Events done with go back to ``pool``."""
    keep = []
    dur, known = ring.arrays["duration"], ring.valid["duration"]
    for row, ev0, ev1 in pending:
        if ring.count - row > ring.capacity:
            pool.extend((ev0, ev1))
            continue
        try:
            done = ev1.query()
        except Exception as exc:
            record_error("torch trace: cuda event", exc)
            continue
        if done:
            dur[row % ring.capacity] = ev0.elapsed_time(ev1) / 1000.0
            known[row % ring.capacity] = True
            pool.extend((ev0, ev1))
        else:
            keep.append((row, ev0, ev1))
    return keep


def landed_stats(ring, pending: list) -> list:
    """Write the output statistics of ``pending`` (``Batch``) whose device copies have landed into
    ``ring``; returns those still waiting (a batch whose rows the ring has overwritten is dropped)."""
    keep = []
    for batch in pending:
        try:
            if batch.stale(ring.count, ring.capacity) or batch.write(ring):
                continue
        except Exception as exc:
            record_error("torch trace: output statistics", exc)
            continue
        keep.append(batch)
    return keep


# -- host-device syncs -------------------------------------------------------------------------------
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
