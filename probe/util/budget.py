"""A share of time that the probe's own work may spend: a token bucket of nanoseconds.

Every step earns ``share`` of its duration; the probe's measured work spends it. Work that
can be skipped runs only while the bucket holds credit, so over any stretch of training
the probe spends at most ``share`` of the step time plus one burst (``share`` of
``BURST_S`` seconds of training, which is also the credit a job starts with: a short
or slow job is measured at every step). Credit is capped both ways, so a stretch of slow
steps does not buy an unbounded burst later and a stretch of fast ones does not starve
the job for long: when the fixed work alone exceeds the share (steps of a few hundred
microseconds), optional work still runs once every ``max_gap_s`` seconds. One charge is at
most a quarter of the burst: on a busy machine a boundary that lost the CPU to another
process for milliseconds is not the probe's cost, and must not stop measuring for a second.

The same bucket paces the whole step boundary (``PROBE_STEP_BUDGET``: loss read-back,
grad norm, peak memory, discovery scans, module-trace scheduling), inside it the probe's
own gradient-norm computation (``PROBE_GRAD_NORM``), and the server's snapshots, which
earn a share of wall time instead of step time (``PROBE_SERVE_SHARE``, ``probe.agent.snapshot``).

>>> b = Budget(0.01, burst_s=0.01)    # 1 % of step time, 100 us of burst credit
>>> b.allows(0)
True
>>> for _ in range(5): b.spend(25_000)    # 125 us of optional work
>>> b.allows(1_000)                   # in debt: skip optional work
False
>>> for _ in range(5): b.earn(1_000_000)   # five 1 ms steps earn 50 us
>>> b.allows(2_000)
True
>>> b.spend(10_000_000)               # one boundary is charged at most a quarter of the burst
>>> round(b.credit)
0
>>> b.tick(1_000_000, 3_000, 5_000)     # a step of 1 ms after a boundary of 5 us: pay, earn, ask at once
True
>>> round(b.credit)
5000
>>> b.tick(4_000_000, 4_000, 60_000, boundaries=4)   # four steps settled at once: 60 us of work, 40 us earned
False
>>> b.due_ns(4_000, 0.005)            # at 0.5 % spent, the other 0.5 % earns 15 us back in 3 ms of steps
3004000
>>> b.due_ns(4_000, 0.005, 10_000)    # and 10 us more in 2 ms when 10 us of work is yet to be charged
5004000
"""

from __future__ import annotations

import math


BURST_S = 1.0  # seconds of step time whose share may be spent at once (and the starting credit)


class Budget:
    __slots__ = ("share", "credit", "cap", "max_gap_ns", "last_allowed_ns", "charge_cap", "floor")

    def __init__(
        self,
        share: float,
        burst_s: float = BURST_S,
        max_gap_s: float | None = None,
        charge_cap: float = 0.25,
        debt_cap: float = 1.0,
    ):
        """``share``: the fraction of time allowed; ``inf`` allows everything, ``0`` nothing.

        ``max_gap_s``: when given, ``allows`` says yes at least once per that many seconds
        whatever the credit (so a value is never left unmeasured for long).
        ``charge_cap``: the largest single charge, as a fraction of the burst (a quarter for
        wall-clock charges, which a lost time slice inflates; CPU-time charges need none: ``inf``).
        ``debt_cap``: the largest debt, in bursts (one by default, so nothing waits longer than ``burst_s`` for
        credit); ``inf`` charges every cost in full, however long the wait it buys (the server's snapshots,
        whose cost a client chooses).
        """
        self.share = share
        self.cap = share * burst_s * 1e9 if math.isfinite(share) else math.inf
        self.credit = self.cap
        self.max_gap_ns = None if max_gap_s is None else int(max_gap_s * 1e9)
        self.last_allowed_ns = 0
        self.charge_cap = charge_cap
        self.floor = -debt_cap * self.cap if math.isfinite(self.cap) else -math.inf

    def earn(self, duration_ns: float) -> None:
        """A step of ``duration_ns`` nanoseconds ended: its share becomes credit."""
        c = self.credit + self.share * duration_ns
        self.credit = c if c < self.cap else self.cap

    def spend(self, ns: float) -> None:
        """The probe spent ``ns`` nanoseconds of its own work (charged at most ``charge_cap`` of the burst)."""
        most = self.charge_cap * self.cap
        c = self.credit - (ns if ns < most else most)
        self.credit = c if c > self.floor else self.floor

    def tick(self, duration_ns: float, now_ns: int, spent_ns: float, boundaries: int = 1) -> bool:
        """Settle the steps since the last tick in one call: pay ``spent_ns`` (the work of the
        ``boundaries`` boundaries since, each charged at most ``charge_cap`` of the burst), earn the
        share of ``duration_ns`` (their steps' time), and say whether optional work may run now
        (``allows``). The same arithmetic as ``spend``, ``earn``, ``allows`` in that order."""
        most = self.charge_cap * self.cap * boundaries
        cap = self.cap
        c = self.credit - (spent_ns if spent_ns < most else most)
        if c < -cap:
            c = -cap
        c += self.share * duration_ns
        self.credit = c = c if c < cap else cap
        if c > 0 or (self.max_gap_ns is not None and now_ns - self.last_allowed_ns >= self.max_gap_ns):
            self.last_allowed_ns = now_ns
            return self.share > 0
        return False

    def due_ns(self, now_ns: int, spend_rate: float, pending_ns: float = 0.0) -> float:
        """When ``allows`` may next say yes if the steps keep costing ``spend_rate`` of their time and
        ``pending_ns`` is charged first (work done but not settled yet, such as the asking boundary's own:
        left out, asking as soon as the credit is back to zero finds it in debt again by that much, and
        a caller whose asking costs more than a step earns would ask again at every other step): now
        when in credit, else when the rest of the share has earned the debt back, and at the latest when
        ``max_gap_s`` runs out (infinity if never). Lets a caller skip asking until then."""
        most = self.charge_cap * self.cap
        credit = self.credit - (pending_ns if pending_ns < most else most)
        if credit > 0:
            return now_ns
        latest = math.inf if self.max_gap_ns is None else self.last_allowed_ns + self.max_gap_ns
        net = self.share - spend_rate
        if net <= 0 or not math.isfinite(net):
            return latest
        return min(now_ns + int(-credit / net), latest)

    def wait_ns(self) -> float:
        """How long, earning at ``share`` of wall time, until the credit is positive again (0 when it is)."""
        if self.credit > 0 or self.share == math.inf:
            return 0.0
        return math.inf if self.share <= 0 else (1.0 - self.credit) / self.share

    def allows(self, now_ns: int) -> bool:
        """Whether optional work may run now (``now_ns``: ``time.perf_counter_ns()``)."""
        if self.credit > 0 or (self.max_gap_ns is not None and now_ns - self.last_allowed_ns >= self.max_gap_ns):
            self.last_allowed_ns = now_ns
            return self.share > 0
        return False
