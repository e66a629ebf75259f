"""Module tracing for sampled steps (``python.torch_trace``, one row per module call) and the host-device syncs
of those steps (``torch.syncs``); docs/torch.md describes both.

torch's global forward pre/post hooks go in at the boundary before a sampled step and out at the boundary after
it, so other steps run torch's hook-free path; the hooks (``tracecalls``) append a tuple per call, and names,
sequence numbers and the ring write wait for the boundary. Steps 1-3 are traced, then one step in
``PROBE_TRACE`` (default ``DEFAULT_EVERY``): set, it is kept to the step (``hard_at``, which the quick path
checks); unset, ``TracePacing`` traces a sampled step once the step budget measures one at or after it, the
hooks' cost charged to the budget. CUDA durations come from event pairs read once completed, never by a sync.
Backward is cut per root model (its row runs from autograd reaching its output to reaching the next root's), and
a module call made during a backward pass is an activation checkpoint's recomputation (stage ``recompute``, on a
stack of its own, at the depth the module had in the forward).

``SyncWatch``: on traced CUDA steps torch's sync debug mode is set to "warn", and probe's ``showwarning`` counts
each "synchronizing CUDA operation" warning by the user's call site instead of printing it (other warnings go to
the previous one; a job that set its own mode is left alone).
"""

from __future__ import annotations

import math
import os
import random
import re
import sys
import threading
import time
import warnings

from . import tracecalls as calls
from ..config import setting
from .._identity import rank_identity
from ..util.errorlog import record_error
from ..util.procfs import RssReader
from ..util.ring import Ring
from ..util.usercode import user_frame

DEFAULT_EVERY = 100
TRACE_COLUMNS = dict(step="i8", seq="i8", module="O", stage="O", duration="f8", allocated="f8", max_allocated="f8")
TRACE_COLUMNS.update(time="f8", rank="f8", depth="i8", model="O", module_type="O", **calls.STATS_COLUMNS)


_quieted = False


def _quiet_compile_warning() -> None:
    """Silence torch's per-call warning that global hooks also fire for a compiled module's wrapper (the probe's
    hooks trigger it, and the trace counts the wrapper as one call). Added once: every change to the filters
    resets Python's "shown once" memory of other warnings."""
    global _quieted
    if _quieted:
        return
    warnings.filterwarnings(
        "ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks", category=UserWarning
    )
    _quieted = True


class Tracer:
    """The module tracer of this process (one, made by ``hooks``): hooks on its sampled steps, and their rows. The
    hooks (``tracecalls.call_hooks``) use ``stack``, ``rstack``, ``rows``, ``recomputed``, ``out_stats``,
    ``read_mem`` and ``mem``, ``new_event`` and ``watch_backward``."""

    def __init__(self, torch, every: int | None = None, capacity: int | None = None, stats: bool | None = None):
        self.torch = torch
        if every is None:
            every = setting("PROBE_TRACE")
        self.every = DEFAULT_EVERY if every is None else every
        self.jittered = every is None  # the default sampling is jittered; PROBE_TRACE=N is kept to every Nth step
        self.ring = Ring(TRACE_COLUMNS, int(capacity or setting("PROBE_TRACE_CAPACITY")))
        self.rank = rank_identity()["rank"]
        self.cuda = bool(torch.cuda.is_available() and torch.cuda.is_initialized()) if hasattr(torch, "cuda") else False
        self.handles: list = []
        self.active_step: int | None = None
        self.rows: list = []  # (module, t0, t1, mem, depth[, ev0, ev1]) per call
        self.backward: list = []  # (root, t0, t1, mem, ev0, ev1)
        self._open_backward = None  # (root, t0, ev0): the backward row being timed in the current pass
        self._pass_queued = False  # the end-of-pass callback is queued
        self.pending_events: list = []  # (ring row, ev0, ev1) awaiting completion (CUDA)
        self.names = calls.ModuleNames()
        self._rss = RssReader()
        self.mem = [0.0, float("nan")]  # time of last reading, value
        self._event_pool: list = []
        self._failed = False
        self.stack: list = []  # the hooks' open calls; emptied at each boundary (a raise can strand one)
        self.rstack: list = []  # the open calls of a recomputation during backward (activation checkpointing)
        self.recomputed: list = []  # (module, t0, t1, mem[, ev0, ev1]) per recomputed call
        self._lock = threading.Lock()
        self.stats_on = setting("PROBE_TRACE_STATS") if stats is None else stats
        self.out_stats: list = []  # the output statistics of each forward row (``recorder``), in step with rows
        self.pending_stats: list = []  # ``Batch``es awaiting their device copies
        self._stats_new_step = None  # the installed recorder's per-step reset
        self.syncs = SyncWatch(torch, self.rank)
        self.syncs_on = setting("PROBE_TRACE_SYNCS")
        self._jitter = random.Random().randrange  # its own generator: the job's random state is not touched

    # -- sampling ---------------------------------------------------------------------------
    def sampled(self, step: int) -> bool:
        if self.every <= 0 or self._failed:
            return False
        return self.every == 1 or step <= 3 or step % self.every == 0

    def next_sampled(self, after: int) -> int | float:
        """The next sampled step after ``after`` (infinity when tracing is off): by default one at random in each
        period of ``every`` steps (traced steps never line up with a period of the job's own); PROBE_TRACE=N: every
        Nth step."""
        every = self.every
        if every <= 0 or self._failed:
            return float("inf")
        if every == 1 or after < 3:
            return after + 1
        return (after // every + 1) * every + (self._jitter(every) if self.jittered else 0)

    def prepare(self, step: int, want: bool | None = None) -> None:
        """At the boundary before ``step``: hooks in if it is traced (``want``, by default if sampled), else out."""
        if want is None:
            want = self.sampled(step)
        self.stack.clear()
        self.rstack.clear()
        if not self.cuda and want and self.torch.cuda.is_initialized():
            self.cuda = True  # CUDA came up after the probe: time device work from now on
            self._remove()
        if want and not self.handles:
            self._install()
        elif not want and self.handles:
            self._remove()
        self.active_step = step if want else None
        if want and self.syncs_on:
            self.syncs.start(self.cuda)
        elif not want:
            self.syncs.stop(None)

    # -- hooks ---------------------------------------------------------------------------------
    def read_mem(self) -> float:
        return float(self.torch.cuda.memory_allocated()) if self.cuda else self._rss()

    def _install(self) -> None:
        """Install the global forward pre/post hook pair for one sampled step (``call_hooks``: what they record)."""
        stat = None
        if self.stats_on:
            try:
                stat = calls.recorder(self.torch, self.cuda)
                self._stats_new_step = stat.new_step
            except Exception as exc:
                record_error("torch trace: output statistics", exc)
        pre, post = calls.call_hooks(self, stat)
        mm = self.torch.nn.modules.module
        _quiet_compile_warning()
        try:
            self.handles = [mm.register_module_forward_pre_hook(pre), mm.register_module_forward_hook(post)]
        except Exception as exc:
            self._failed = True
            record_error("torch trace: installing hooks", exc)

    def _remove(self) -> None:
        for h in self.handles:
            try:
                h.remove()
            except Exception as exc:
                record_error("torch trace: removing hooks", exc)
        self.handles = []

    def new_event(self):
        """A timing CUDA event (from the pool of those read already), recorded now on the current stream."""
        pool = self._event_pool
        ev = pool.pop() if pool else self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def watch_backward(self, root, output) -> None:
        """Time the backward pass of a root model: autograd reaching its output, to the pass's end."""
        try:
            t = output
            if isinstance(t, (tuple, list, dict)):
                t = next((x for x in (t.values() if isinstance(t, dict) else t) if getattr(x, "grad_fn", None)), None)
            fn = getattr(t, "grad_fn", None)
            if fn is None:
                return
            fn.register_prehook(lambda grad_outputs: self._backward_reached(root))
        except Exception as exc:
            record_error("torch trace: backward hook", exc)

    def _backward_reached(self, root) -> None:
        """Autograd reached ``root``'s output: the backward row open so far (the previous root's) ends here, so the
        rows of one pass add up to the pass (a loss module called at top level gets the loss's own backward)."""
        try:
            now = time.perf_counter()
            ev = self.new_event() if self.cuda else None
            self._close_backward(now)
            self._open_backward = (root, now, ev)
            if not self._pass_queued:
                self._pass_queued = True
                self.torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)
        except Exception as exc:
            record_error("torch trace: backward hook", exc)
        return None

    def _close_backward(self, now: float) -> None:
        opened, self._open_backward = self._open_backward, None
        if opened is None:
            return
        root, t0, ev0 = opened
        ev1 = self.new_event() if self.cuda else None
        self.backward.append((root, t0, now, self.read_mem(), ev0, ev1))

    def _backward_finished(self) -> None:
        try:
            self._pass_queued = False
            self._close_backward(time.perf_counter())
        except Exception as exc:
            record_error("torch trace: backward hook", exc)

    def first_call_perf(self) -> float | None:
        """perf_counter time of the first module call traced in the current step, if any."""
        rows = self.rows
        return rows[0][1] if rows else None

    # -- flushing -----------------------------------------------------------------------------
    def finish(self, step: int, wall_offset: float) -> None:
        """At the boundary after a traced step: write its rows (``wall_offset`` maps perf_counter to epoch)."""
        if self.pending_stats:  # an earlier traced step's device copies landed long ago: into the ring
            self.resolve()
        # The hooks hold these lists: take their contents and empty them in place.
        rows, back, again = self.rows[:], self.backward[:], self.recomputed[:]
        del self.rows[: len(rows)], self.backward[: len(back)], self.recomputed[: len(again)]
        self.rstack.clear()
        out = self.out_stats[: len(rows)]
        del self.out_stats[:]
        if self._stats_new_step is not None:
            self._stats_new_step()
        if len(out) != len(rows):
            out = [None] * len(rows)
        self.syncs.stop(step)
        if not rows and not back and not again:
            return
        records = calls.step_records(rows, out, back, again, self.names.name_of)
        n = len(records)
        cols = calls.columns(records, step, wall_offset, self.rank, self.cuda)
        cols.update(self._stats_columns(records))
        if self.cuda:
            base = self.ring.count + max(0, n - self.ring.capacity)
            with self._lock:
                for i, r in enumerate(records[max(0, n - self.ring.capacity) :]):
                    if r[8] is not None and r[9] is not None:
                        self.pending_events.append((base + i, r[8], r[9]))
        self.ring.extend(cols, n)

    def _stats_columns(self, records) -> dict:
        """The output-statistics columns of a step's records (sorted as written): CPU values now, CUDA ones later."""
        import numpy as np

        n = len(records)
        keep = max(0, n - self.ring.capacity)
        base = self.ring.count + keep
        try:
            batch = calls.Batch(self.torch, range(base, base + n - keep), [r[10] for r in records[keep:]])
            cols = batch.columns()
        except Exception as exc:
            record_error("torch trace: output statistics", exc)
            return {
                name: np.ma.masked_all(n) if dt == "f8" else np.full(n, None, dtype=object)
                for name, dt in calls.STATS_COLUMNS.items()
            }
        if keep:
            cols = {
                k: np.ma.concatenate((np.ma.masked_all(keep), v))
                if v.dtype.kind == "f"
                else np.concatenate((np.full(keep, None, dtype=v.dtype), v))
                for k, v in cols.items()
            }
        if batch.parts:
            with self._lock:
                self.pending_stats.append(batch)
        return cols

    def resolve(self) -> None:
        """Fill in CUDA durations and output statistics whose copies have completed; never waits."""
        with self._lock:
            if self.pending_events:
                self.pending_events = calls.landed_durations(self.ring, self.pending_events, self._event_pool)
            if self.pending_stats:
                self.pending_stats = calls.landed_stats(self.ring, self.pending_stats)

    def close(self) -> None:
        self._remove()
        self.syncs.stop(None)
        self.active_step = None


# -- when tracing runs -------------------------------------------------------------------------------
class TracePacing:
    """When tracing runs: ``due`` (the next sampled step), ``paced`` (PROBE_TRACE unset), ``hard_at`` (PROBE_TRACE
    set: the step before the next traced one) and ``typical_ns`` (the running mean of untraced steps' durations)."""

    def __init__(self, tracer):
        self.tracer = tracer
        self.paced = setting("PROBE_TRACE") is None
        self.due = tracer.next_sampled(0)
        self.hard_at = math.inf
        self.typical_ns = 0.0

    def wants_turn(self, step: int, traced: bool, measure: bool) -> bool:
        """Whether the boundary closing ``step`` has tracer work (a traced step, hooks, device events, a trace due)."""
        tracer = self.tracer
        return bool(
            traced or tracer.handles or tracer.pending_events or (step + 1 >= self.due and (measure or not self.paced))
        )

    def turn(self, step: int, traced: bool, measure: bool, wall_offset: float) -> int:
        """The tracer's turn at the boundary: finish a traced step, read its device timings, prepare the next step.
        Returns the ns of a trace the user asked for (PROBE_TRACE set): shown in probe_us, not paced."""
        tracer = self.tracer
        asked = 0
        nxt = step + 1
        try:
            if traced:
                t1 = time.perf_counter_ns()
                tracer.finish(step, wall_offset)
                if not self.paced:
                    asked = time.perf_counter_ns() - t1
            if tracer.pending_events:
                tracer.resolve()
            if nxt >= self.due and (measure or not self.paced):
                self.due = tracer.next_sampled(nxt)
                if not self.paced:
                    self.hard_at = self.due - 1
                tracer.prepare(nxt, True)
            elif tracer.handles or tracer.active_step is not None:
                tracer.prepare(nxt, False)
        except Exception as exc:
            record_error("torch trace: step boundary", exc)
        return asked

    def charge(self, budget, duration_ns: float, traced: bool) -> None:
        """On a measured step: charge what a traced step's hooks added to ``budget``, or learn an untraced one's."""
        typical = self.typical_ns
        if traced:
            if typical > 0 and duration_ns > typical:
                budget.spend(duration_ns - typical)
        elif typical > 0:
            self.typical_ns += (duration_ns - typical) * 0.125
        else:
            self.typical_ns = duration_ns


# -- host-device syncs -------------------------------------------------------------------------------
SYNC_MESSAGE = "called a synchronizing CUDA operation"
SYNC_COLUMNS = dict(step="i8", time="f8", rank="f8", file="O", line="i8", function="O", code="O", count="i8")
SYNC_COLUMNS.update(origin="O", via="O")
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
