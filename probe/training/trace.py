"""Module tracing for sampled steps: one ``python.torch_trace`` row per module call.

Tracing uses torch's global forward pre/post hooks, installed at the boundary before
a sampled step and removed at the boundary after it, so unsampled steps run torch's
hook-free fast path. The hot path only appends a tuple to a list; names, sequence
numbers and the ring write happen once per traced step, vectorised with numpy.

Sampling is deterministic by step number (the same steps on every rank): steps 1-3
(the first steps show start-up costs) and every N-th step after, N from
``PROBE_TRACE`` (default ``DEFAULT_EVERY``); ``all`` traces every step, ``off`` none.

Durations: perf_counter on CPU; on CUDA a pair of CUDA events per call, resolved
when the events have completed (a later boundary or query), never synchronising.
``allocated`` is the CUDA allocator's current bytes on GPU runs, else the process
RSS; it is read at most every ``tracecalls.MEM_PERIOD`` seconds (the last reading is
reused).
Backward is traced per root model (a module called at top level, a loss module
included), as a cut of the backward pass: a root's row runs from the moment autograd
reaches its output to the moment it reaches the next root's output, or to the end of the
pass. The backward rows of a pass therefore add up to the pass and never overlap.

Activation checkpointing (``torch.utils.checkpoint``, reentrant or not) runs a checkpointed
part's forward again during backward. A module call made while autograd runs a backward pass
is such a recomputation: its row has stage ``recompute`` (not ``forward``, so the forward
totals count each call once), it is kept on a stack of its own (a non-reentrant recomputation
stops early, past the post hooks of the calls it interrupts, and those must not deepen
anything), and its depth is the depth the same module had in the step's forward.

When tracing runs (``TracePacing``): unset, PROBE_TRACE lets the probe pace it: the tracer samples a next step
(``Tracer.next_sampled``), and that step is traced only once the step budget measures one at or after it, with the
hooks' cost charged to the budget (what a traced step took over the running mean of untraced ones). Set, it is
kept to the step: ``hard_at`` is the step before the next traced one, which the step tracker's quick path checks.
"""

from __future__ import annotations

import math
import random
import threading
import time

from .tracecalls import STATS_COLUMNS, Batch, call_hooks, recorder
from .traceout import ModuleNames, SyncWatch, columns, landed_durations, landed_stats, step_records
from ..config import setting
from .._identity import rank_identity
from ..util.errorlog import record_error
from ..util.procfs import RssReader
from ..util.ring import Ring

DEFAULT_EVERY = 100
TRACE_COLUMNS = {
    "step": "i8",
    "seq": "i8",
    "module": "O",
    "stage": "O",
    "duration": "f8",
    "allocated": "f8",
    "max_allocated": "f8",
    "time": "f8",
    "rank": "f8",
    "depth": "i8",
    "model": "O",
    "module_type": "O",
    **STATS_COLUMNS,
}


_quieted = False


def _quiet_compile_warning() -> None:
    """Silence torch's per-call warning that global hooks also fire for a compiled module's wrapper.

    The probe's sampled-step hooks are what trigger it, not the user's code, and the
    trace accounts for the wrapper (the compiled module is one traced call). Added once:
    every change to the filters resets Python's "shown once" memory of other warnings.
    """
    global _quieted
    if _quieted:
        return
    import warnings

    warnings.filterwarnings(
        "ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks", category=UserWarning
    )
    _quieted = True


class Tracer:
    """The module tracer of this process (one, made by ``hooks``): hooks on its sampled steps, and their rows.

    The hooks (``call_hooks``) keep the open calls on ``stack`` (``rstack``: those recomputed
    during backward), append to ``rows``, ``recomputed`` and ``out_stats``, read memory through ``read_mem``
    at most every ``MEM_PERIOD`` into ``mem`` (time of the reading, value), CUDA events from ``new_event``,
    and hand each root's output to ``watch_backward``.
    """

    def __init__(self, torch, every: int | None = None, capacity: int | None = None, stats: bool | None = None):
        self.torch = torch
        if every is None:
            every = setting("PROBE_TRACE")
        self.every = DEFAULT_EVERY if every is None else every
        self.jittered = (
            every is None
        )  # the default sampling is jittered; an explicit PROBE_TRACE=N is kept to every Nth step
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
        self.names = ModuleNames()
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
        """The next sampled step after ``after`` (infinity when tracing is off): by default one step at
        random in each period of ``every`` steps after the first three, so that the traced steps cannot
        line up with a period of the job's own (two DataLoader workers: fast and slow steps in turn);
        with an explicit PROBE_TRACE=N, every Nth step as asked."""
        every = self.every
        if every <= 0 or self._failed:
            return float("inf")
        if every == 1 or after < 3:
            return after + 1
        return (after // every + 1) * every + (self._jitter(every) if self.jittered else 0)

    def prepare(self, step: int, want: bool | None = None) -> None:
        """Called at the boundary before ``step``: install hooks if it is to be traced (``want``, by
        default whether it is sampled), else make sure none are."""
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
        if self.cuda:
            return float(self.torch.cuda.memory_allocated())
        return self._rss()

    def _install(self) -> None:
        """Install the global forward pre/post hook pair for one sampled step (``call_hooks``: what they record)."""
        stat = None
        if self.stats_on:
            try:
                stat = recorder(self.torch, self.cuda)
                self._stats_new_step = stat.new_step
            except Exception as exc:
                record_error("torch trace: output statistics", exc)
        pre, post = call_hooks(self, stat)
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
        pool = self._event_pool
        return pool.pop() if pool else self.torch.cuda.Event(enable_timing=True)

    def watch_backward(self, root, output) -> None:
        """Time the backward pass of a root model: autograd reaching its output, to the pass's end."""
        try:
            t = output
            if isinstance(t, (tuple, list)):
                t = next((x for x in t if getattr(x, "grad_fn", None) is not None), None)
            elif isinstance(t, dict):
                t = next((x for x in t.values() if getattr(x, "grad_fn", None) is not None), None)
            fn = getattr(t, "grad_fn", None)
            if fn is None:
                return
            fn.register_prehook(lambda grad_outputs: self._backward_reached(root))
        except Exception as exc:
            record_error("torch trace: backward hook", exc)

    def _backward_reached(self, root) -> None:
        """Autograd reached ``root``'s output: the backward row open so far (the previous root's) ends here.

        The backward pass is cut where autograd reaches each root's output, in the order it does:
        a root's row runs from there to where the next root's output is reached, or to the end
        of the pass. So the rows of one pass add up to the pass, and nothing is counted twice
        (a loss module called at top level gets the loss's own backward, not the whole pass).
        """
        try:
            now = time.perf_counter()
            ev = None
            if self.cuda:
                ev = self.new_event()
                ev.record()
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
        ev1 = None
        if self.cuda:
            ev1 = self.new_event()
            ev1.record()
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
        records = step_records(rows, out, back, again, self.names.name_of)
        n = len(records)
        cols = columns(records, step, wall_offset, self.rank, self.cuda)
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
        n = len(records)
        keep = max(0, n - self.ring.capacity)
        base = self.ring.count + keep
        try:
            batch = Batch(self.torch, range(base, base + n - keep), [r[10] for r in records[keep:]])
            cols = batch.columns()
        except Exception as exc:
            record_error("torch trace: output statistics", exc)
            import numpy as np

            return {
                name: np.ma.masked_all(n) if dt == "f8" else np.full(n, None, dtype=object)
                for name, dt in STATS_COLUMNS.items()
            }
        if keep:
            import numpy as np

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
            self._resolve()
            self._resolve_stats()

    def _resolve_stats(self) -> None:
        if self.pending_stats:
            self.pending_stats = landed_stats(self.ring, self.pending_stats)

    def _resolve(self) -> None:
        if self.pending_events:
            self.pending_events = landed_durations(self.ring, self.pending_events, self._event_pool)

    def close(self) -> None:
        self._remove()
        self.syncs.stop(None)
        self.active_step = None


# -- when tracing runs -------------------------------------------------------------------------------
class TracePacing:
    """The schedule of module tracing: ``due`` (the next sampled step), ``paced`` (PROBE_TRACE unset),
    ``hard_at`` (with PROBE_TRACE set: the step before the next traced one, else never) and
    ``typical_ns`` (a running mean of untraced step durations: what tracing a step adds)."""

    def __init__(self, tracer):
        self.tracer = tracer
        self.paced = setting("PROBE_TRACE") is None
        self.due = tracer.next_sampled(0)
        self.hard_at = math.inf
        self.typical_ns = 0.0

    def wants_turn(self, step: int, traced: bool, measure: bool) -> bool:
        """Whether the boundary closing ``step`` has tracer work: a traced step to finish, hooks or device
        events outstanding, or the next step due for a trace (paced: only if it is measured)."""
        tracer = self.tracer
        return bool(
            traced or tracer.handles or tracer.pending_events or (step + 1 >= self.due and (measure or not self.paced))
        )

    def turn(self, step: int, traced: bool, measure: bool, wall_offset: float) -> int:
        """The tracer's turn at the boundary: finish a traced step, read its device timings, and prepare
        the next step (traced or not). Returns the ns of a trace the user asked for (PROBE_TRACE set):
        shown in probe_us, not paced."""
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
        """On a measured step: charge what a traced step's hooks added to ``budget``, or learn an untraced
        step's duration."""
        typical = self.typical_ns
        if traced:
            if typical > 0 and duration_ns > typical:
                budget.spend(duration_ns - typical)
        elif typical > 0:
            self.typical_ns += (duration_ns - typical) * 0.125
        else:
            self.typical_ns = duration_ns
