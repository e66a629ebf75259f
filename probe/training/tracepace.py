"""When module tracing runs: which steps ``trace.Tracer`` traces, and its turn at each step boundary.

Unset, PROBE_TRACE lets the probe pace tracing: the tracer samples a next step
(``Tracer.next_sampled``), and that step is traced only once the step budget measures one at
or after it, with the hooks' cost charged to the budget (``charge``: what a traced step took
over the running mean of untraced ones). Set, it is kept to the step: ``hard_at`` is the step
before the next traced one, which the step tracker's quick path checks, so that the step is
prepared even when nothing else would be.
"""

from __future__ import annotations

import math
import time

from ..config import setting
from ..util.errorlog import record_error

__all__ = ["TracePacing"]

_perf_ns = time.perf_counter_ns


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
                t1 = _perf_ns()
                tracer.finish(step, wall_offset)
                if not self.paced:
                    asked = _perf_ns() - t1
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
