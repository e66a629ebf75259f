"""Step bookkeeping: one ``torch.steps`` row per training step, and the step boundary.

A step ends at the *lead* optimizer's ``step()`` (``probe.watch(optimizer=...)``'s, else the first seen
stepping); with several optimizers ``steprows.cycle_step`` ends an iteration after its last one; gradient
accumulation needs nothing (``micro_batches``, samples and tokens add up); ``probe.step()`` calls own the count.

The core signals are recorded on every step: step count, step time, lr, the loss (``capture``: a CPU scalar read
at once, a device one copied without blocking and read when ready), the time before the step's first forward call
(``data_wait``); memory is read by ``steprows.MemoryClock``'s thread. The optional values (the grad norm, input
counts, the frame-variable loss fallback) and the occasional work (discovery scans, module trace scheduling) run
on the steps the ``PROBE_STEP_BUDGET`` bucket allows (the row's ``measured``), jittered by a coin so that a job's
own period cannot line up with them. Each boundary's own cost is kept (``probe_us``). Other steps take the quick
path (``on_optimizer_step``): the exact values only. ``started_at``, the rates and ``rank`` are derived at query.

The hot path never synchronises with a device: device values are read once landed (``util.ring.Pending``), the
ring holding None (SQL NULL) until then. A NaN or infinite loss is kept, so ``isnan(loss)`` finds where it went bad.
"""

from __future__ import annotations

import math
import random
import sys
import time
import weakref

from . import finder, invariants, signals, weights
from .._core.boundary import boundary as _boundary
from .frameworks import unwrap_optimizer
from .trace import TracePacing
from ..util.budget import Budget
from .capture import Capture
from .steprows import RING_COLUMNS, MemoryClock, OptimizerCycle, cycle_step
from ..config import setting
from .._identity import rank_identity
from ..util.errorlog import record_error
from ..util.procfs import CpuWait
from ..util.ring import Pending, Ring
from ..util.usercode import user_frame

_perf_ns = time.perf_counter_ns
# the boundary's registrations, never rebound: one global read each on the quick path
_after, _before, _undo, _passed = _boundary.after, _boundary.before, _boundary.undo, _boundary.passed

_LAG = 2  # steps after which a pending value is read on the training thread
_RESOLVE_EVERY = 8  # pending device values read at the boundary once this many are waiting
_NORM_BURST_S = 30.0  # seconds of step time whose norm share may be spent at once (and waited for)
_MAX_GAP_S = 1.0  # a step is measured at least this often, whatever the budget
# What the budget charges per ns of the probe's own timing (probe_us): torch's hook dispatch, the wrappers and the
# caches refilled after a boundary cost the step about as much again as the boundary's own work.
_CHARGE = 2.0
_FORCED = 3  # steps 1-3 are always measured (start-up divergence shows there)


def _closure(args, kwargs):
    """The closure an optimizer step was given (``args[0]`` is the optimizer), or None."""
    return args[1] if args[1:] else kwargs.get("closure") if kwargs else None


def norm_budget() -> Budget:
    """The gradient norm's own budget (PROBE_GRAD_NORM). The norm of a large model's gradients takes
    milliseconds on CPU: each is charged in full (no cap) and may put the budget in debt for up to
    _NORM_BURST_S of steps, else a norm costing more than the whole burst would run every few steps
    whatever the share."""
    return Budget(setting("PROBE_GRAD_NORM"), burst_s=_NORM_BURST_S, charge_cap=math.inf)


class StepTracker:
    """The step count and the step boundary of this process's training loop (one, made by ``hooks``).

    Read and set by others: ``step`` (steps completed), ``explicit`` (``probe.step()`` owns the count), ``ring``
    (the ``torch.steps`` rows, ``steprows.RING_COLUMNS``) and ``pending`` (its device values not read yet),
    ``capture`` (loss and grad norm), ``inputs`` (micro-batches, samples, tokens), ``memory``, ``tracer``,
    ``budget`` and ``norm_budget`` (PROBE_STEP_BUDGET, PROBE_GRAD_NORM), ``trace_pacing``, ``lead`` (weakref to
    the lead optimizer), ``cycle`` (``steprows.OptimizerCycle`` once a second optimizer steps), ``step_lr`` and
    ``used_lr`` (the lr an override made this step use, set before the boundary), ``wall_offset`` (time.time()
    minus perf_counter()) and ``rank``. The quick path's state is described in ``on_optimizer_step``."""

    def __init__(self, torch, tracer, inputs):
        # The quick path's attributes first: stored in the order first set, they share a cache line or two
        self._check_at = 0
        self._full_at = math.inf
        self.step = 0
        self._lead_id = None  # id() of the lead optimizer while it lives (its weakref's callback clears it)
        self.step_lr = None
        self._last_ns: int | None = None  # the last boundary (perf_counter_ns); None when the clock restarts
        self._quick_ns = 0  # the quick boundaries' cost since the budget was settled
        self.wall_offset = time.time() - time.perf_counter()
        self._lead_name = None
        self._before_hook = None  # torch's optimizer step pre-hook, while one is needed (``hook_before``)
        self.lead = None
        self.ring = Ring(RING_COLUMNS, setting("PROBE_STEPS_CAPACITY"))
        self.capture = Capture(torch)
        self.capture.ends_step = lambda: not self.explicit and self.cycle is None
        self.torch = torch
        self.tracer = tracer
        self._spent = 0  # the budget is settled at full boundaries only: the quick ones add their cost meanwhile
        self._settled_step = 0  # the step whose boundary settled the budget last: the quick ones came after
        self._settled_ns: int | None = None
        self._quick_rate = 0.0
        self.rank = rank_identity()["rank"]
        self._replicas = weights.replicas(torch)  # DDP weight checksums (their due steps take the full boundary)
        self.budget = Budget(setting("PROBE_STEP_BUDGET"), max_gap_s=_MAX_GAP_S)
        self.norm_budget = norm_budget()
        self._norm_earned_ns = time.perf_counter_ns()
        self.trace_pacing = TracePacing(tracer)
        self.explicit = False
        self._started_ns = time.perf_counter_ns()
        self.pending = Pending(self.ring, "torch steps")
        self.inputs = inputs  # hooks.InputCounter
        # the measured steps' jitter, from a generator of its own: the job's random stream is untouched
        self._coin = random.Random().random
        self._scan_due = 1
        self.memory = MemoryClock(torch, lambda: self.step)
        self.cpu_wait = CpuWait()
        self._frame_code, self._frame_depth = None, 0
        self._quick_next = False  # what the boundary in progress found for the next ones (``_check_at``)
        self.cycle = None
        self.used_lr = None
        self.capture.wrap()

    def lr_used(self, optimizer, lr: float) -> None:
        """An lr override made ``optimizer``'s step just taken use ``lr`` (``param_groups`` shows the loop's)."""
        if self.lead_optimizer() is optimizer:
            self.step_lr = lr
        if self.cycle is not None:
            self.used_lr = (optimizer, lr)  # for torch.optimizer_steps when several optimizers step

    def full_next(self) -> None:
        """The next boundary takes the full path (a cycle's optimizer steps, a resume)."""
        self._check_at = 0

    def close(self) -> None:
        self.hook_before(False)
        self.capture.unwrap()
        self.inputs.close()
        self.memory.stop()
        checks = invariants.checks()
        if checks is not None:  # its gradient hook too: a paused probe runs nothing on the loop's steps
            checks.close()
        sig = signals.signals()  # and the update being measured (its step-boundary registration)
        if sig is not None:
            sig.close()

    def reopen(self) -> None:
        """Undo ``close``: the loss and clip wrappers and the root model's hook go back; the next step's clock
        restarts."""
        self.capture.wrap()
        self.hook_before(True)
        self.watch_roots()
        self._last_ns = None
        self._settled_ns = None  # the paused time earns nothing
        self.full_next()
        self._started_ns = now = time.perf_counter_ns()
        # nor towards the budget's floor (a measured step at least once a second of probed training): else a job
        # that pauses often would measure a step at every resume
        self.budget.last_allowed_ns = now

    # -- the lead optimizer --------------------------------------------------------------------
    def set_lead(self, optimizer) -> None:
        optimizer, _ = unwrap_optimizer(optimizer)  # the hooks fire with the inner optimizer
        self.lead = weakref.ref(optimizer, self._lead_gone)
        self._lead_id = id(optimizer)  # a number the quick path compares: calling a weakref costs it ~0.5 us
        self._lead_name = type(optimizer).__name__
        finder.add(optimizer, None, "step hook", "optimizer")

    def _lead_gone(self, ref) -> None:
        """The lead optimizer was freed: its id may be reused (before its memory is, the quick path forgets it)."""
        if ref is self.lead:
            self._lead_id = None

    def lead_optimizer(self):
        return self.lead() if self.lead is not None else None

    def on_optimizer_step(self, optimizer, args=(), kwargs=None) -> None:
        """torch's optimizer step post-hook, registered as it is: the one place that decides how a step ends.

        The quick path, inline, records the exact values (count, times, lr, loss, its own cost), nothing else; on
        a fast loop it is most steps, each operation paid per step. It runs while: ``_check_at`` (set by the last
        full boundary's ``_plan_next``: nothing measured, traced or explicit is due, and the budget cannot allow a
        measured step before then); ``_full_at`` (no replica checksum, asked-for trace or ring flush due); the lead
        optimizer stepped with a float lr and no override (``step_lr``); no ``after_step`` callback nor ``before_step``
        undo; no ``before_step`` callback that the pre-hook, out, did not run (``hook_before``).

        Otherwise the ``before_step`` undo runs (an lr override puts the loop's rate back, and says the rate the
        step used), then ``_full``."""
        t0 = _perf_ns()
        try:
            if t0 < self._check_at and self.step + 1 < self._full_at and id(optimizer) == self._lead_id:
                lr = optimizer.param_groups[0]["lr"]
                capture = self.capture
                if (
                    type(lr) is float
                    and self.step_lr is None
                    and not _after
                    and not _undo
                    and (self._before_hook or not _before)
                ):
                    self.step = step = self.step + 1
                    last = self._last_ns
                    self._last_ns = t0
                    capture.closure_step = False  # Lightning: a closure at every step
                    loss = None
                    losses = capture.losses
                    if losses:  # every step (CPU scalars read when noted)
                        try:
                            loss = losses[0]
                            if len(losses) == 1 and type(loss) is float:  # one backward call's
                                losses.clear()
                            else:  # several (summed; a closure's evaluations: the first), or a tensor (held)
                                self._unseen_closure(args, kwargs)
                                loss = capture.take()
                        except Exception as exc:  # the step's row is still written, without its loss
                            loss = None
                            record_error("torch steps: loss", exc)
                    inputs = self.inputs
                    fwd, inputs.began = inputs.began, 0
                    _boundary.last_step = step  # nothing to run: no callback registered, heartbeats at full ones
                    cost = _perf_ns() - t0
                    self._quick_ns += cost
                    # a row cut short (nothing measured: ``_WRITTEN``) onto the ring's tail, flushed at ``_full_at``
                    wait = (fwd - last) * 1e-9 if fwd > last else None
                    value = loss if type(loss) is float else None
                    ended, took = t0 * 1e-9 + self.wall_offset, (t0 - last) * 1e-9
                    self.ring.tail.append((step, ended, took, value, lr, cost * 1e-3, wait, self._lead_name, 0))
                    self.ring.count += 1
                    if type(loss) is tuple:  # a device loss: read when its copy has landed
                        self._keep_pending(self.ring.count - 1, loss, None, None)
                    return
            if _undo:
                used = _boundary.optimizer_ended(optimizer)
                if used is not None:
                    self.lr_used(optimizer, used)
            self._full(optimizer, t0, args, kwargs)
        except Exception as exc:
            record_error("torch optimizer step hook", exc)

    def _full(self, optimizer, t0: int, args=(), kwargs=None) -> None:
        """Once a second optimizer steps, every step goes to ``steprows.cycle_step``; once ``probe.step()`` owns
        the count, an optimizer step ends nothing; else the full ``boundary``. Then the pre-hook goes in or out."""
        self._unseen_closure(args, kwargs)
        self.capture.closure_step = False
        lead = self.lead
        if lead is None or lead() is not optimizer:
            if lead is None or lead() is None:
                self.set_lead(optimizer)
            else:
                if finder.optimizer_found(optimizer) is None:
                    finder.add(optimizer, None, "step hook", "optimizer")
                if self.cycle is None:  # the lead has stepped unless probe.watch named it beforehand
                    self.cycle = OptimizerCycle(lead() if self.step else optimizer, self.step > 0)
        if self.cycle is not None and not self.explicit:
            cycle_step(self, optimizer, t0)
        elif not self.explicit:
            self.boundary(optimizer, self.loop_frame(), t0=t0)
        self.hook_before(self.capture.wanted or self.capture.closures or bool(_before))

    def _unseen_closure(self, args, kwargs) -> None:
        """A closure step the pre-hook, out, did not see noted every evaluation: the first is its loss (a backward
        before such a step would be); the pre-hook goes in at the next boundary, a full one."""
        capture = self.capture
        if not capture.closure_step and _closure(args, kwargs) is not None:
            capture.closures = True
            del capture.losses[1:]
            self.full_next()

    def before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """torch's global optimizer step pre-hook, while ``hook_before`` has it in: whether the step evaluates a
        closure (only its first backward is the loss; a step given none, after one that closed, has nothing to
        note), and the ``before_step`` callbacks."""
        closure = _closure(args, kwargs)
        if closure is not None or self.capture.closure_step:
            self.capture.on_step_start(closure)  # the boundary ends it (Lightning: every step has one)
        if _before:
            _boundary.optimizer_starts(optimizer)

    def hook_before(self, on: bool) -> None:
        """Put the pre-hook (``before_optimizer_step``) in or out. In while a step may need it: a measured one
        (``torch.checks`` counts its backward calls, a closure's first only), a loop that passed a closure, a
        ``before_step`` registration (one made outside a boundary while it is out runs a step later). A closure
        evaluated twice in a step it did not see is found by the post-hook (``_unseen_closure``)."""
        handle = self._before_hook
        if on and handle is None:
            optim = sys.modules["torch.optim.optimizer"]  # loaded with torch.optim, not its attribute
            self._before_hook = optim.register_optimizer_step_pre_hook(self.before_optimizer_step)
        elif not on and handle is not None:
            self._before_hook = handle.remove()

    def loop_frame(self):
        """The training loop's frame: the first one outside torch and probe above the step hook.

        The loop calls ``optimizer.step()`` from the same code at the same depth every step, so the last answer is
        checked with one ``sys._getframe`` before walking. Only the code object is kept: a frame kept past the
        boundary would keep the step's locals (the loss, the logits) alive through the next step."""
        depth = self._frame_depth
        if depth:
            try:
                f = sys._getframe(depth)
            except ValueError:
                f = None
            if f is not None and f.f_code is self._frame_code:
                return f
        f, hops = user_frame(sys._getframe(1))
        self._frame_depth = 1 + hops if f is not None else 0
        self._frame_code = f.f_code if f is not None else None
        return f

    # -- inputs: samples and tokens per step, and when the step's first forward began (``inputs``) -------
    def watch_roots(self) -> None:
        """Hook the primary model (``InputCounter``), counting the inputs if the next step is measured."""
        self.inputs.watch(self.lead_optimizer(), self.capture.wanted)

    # -- the boundary -----------------------------------------------------------------------------
    def boundary(self, optimizer, frame, *, loss=None, samples=None, tokens=None, t0: int | None = None) -> None:
        """The full boundary: close step ``self.step + 1`` with the optional values if measured, the tracer's and
        the ``after_step`` callbacks' turn, then one ring row (with its own cost, the callbacks' excluded). No
        device syncs. ``t0`` (perf_counter_ns): when the probe's hook was entered, the step's end."""
        if t0 is None:
            t0 = _perf_ns()
        self.step = step = self.step + 1
        if optimizer is None:
            optimizer = self.lead_optimizer()
        last = self._last_ns
        if last is None:  # the first step (or the first after resume): from the first traced module call
            first = self.tracer.first_call_perf()
            last = int(first * 1e9) if first is not None else self._started_ns
        self._last_ns = t0
        duration_ns = t0 - last if t0 > last else 0
        inputs = self.inputs
        fwd, inputs.began = inputs.began, 0
        data_wait = (fwd - last) * 1e-9 if fwd > last else None
        capture = self.capture
        gap_from = self.budget.last_allowed_ns
        allowed = self._settle(t0, last)  # whether the next step may be measured
        if allowed and not capture.wanted and step + 1 > _FORCED and self._coin() < 0.5:
            # jitter: the first step allowed after unmeasured ones is put off by a coin toss (the next full
            # boundary tosses again; the quick path's check is due at once), so measured steps cannot follow
            # a period of the job's own. The one-second floor still counts from the last measured step.
            allowed = False
            self.budget.last_allowed_ns = gap_from
        capture.closure_step = False
        measured = capture.wanted
        loss_v = capture.step_loss(frame, loss, measured)  # a NaN loss stays NaN
        if measured:
            budget = self.norm_budget  # the grad norm's: it earns the time since the last measured step
            budget.earn(t0 - self._norm_earned_ns)
            self._norm_earned_ns = t0
            norm_v = capture.measured_norm(optimizer, budget, t0, step <= _FORCED and budget.share > 0)
            waited = self.cpu_wait.per_step(step)
        else:  # None: not measured (SQL NULL)
            norm_v = waited = None
            if capture.clip_norm is not None:
                capture.clip_norm = None
        lr = self.step_lr
        if lr is not None:
            self.step_lr = None
        elif optimizer is not None:
            try:
                lr = optimizer.param_groups[0]["lr"]
                if type(lr) is not float:
                    lr = capture.hold(lr)  # a tensor lr (capturable optimizers), or an int
            except Exception as exc:
                record_error("torch steps: lr", exc)
        traced = self.tracer.active_step == step
        micro, s, t = self.inputs.take(samples, tokens)
        if measured:
            self._occasional(step, frame, duration_ns, traced)
            checks = invariants.checks(self.torch)  # torch.checks: cheap invariants of training
            checks.at_boundary(step, optimizer, capture, lambda: self.step)
            signals.signals(self.torch).at_boundary(step, optimizer)  # torch.batches/updates/scaler
        if step >= self._replicas.next_step:  # torch.weight_sums: DDP replicas' checksums, the same steps on every rank
            self._replicas.at_boundary(step, duration_ns * 1e-9)
        asked = self._plan_next(step, t0, traced, step + 1 <= _FORCED or allowed)
        callbacks = 0  # the callbacks' work (queued actions) is not the probe's overhead; t0 stays the step's end
        if _after:
            t1 = _perf_ns()
            _passed(step, frame, optimizer)
            callbacks = _perf_ns() - t1
        else:
            _passed(step)  # the heartbeats are the probe's own (the hang watchdog): their cost is the probe's
        sig = signals.signals()  # an update measured in the optimizer's pre-hook since: the probe's work too
        extra = sig.spent_ns if sig is not None else 0
        if extra:
            sig.spent_ns = 0
        cost = _perf_ns() - t0 - callbacks + extra
        self._spent = cost - asked if step > _FORCED else 0  # start-up (first scans, imports, traces) is not paced
        # the quick path may run until the budget could allow a measured step (once it has paid for this boundary,
        # which the next full one charges), and short of the next step due for a replica checksum or a trace the
        # user asked for
        self._check_at = self.budget.due_ns(t0, self._quick_rate, _CHARGE * self._spent) if self._quick_next else 0
        ring = self.ring
        row = ring.count
        name = type(optimizer).__name__ if optimizer is not None else None
        loss_f, lr_f, norm_f = (v if type(v) is float else None for v in (loss_v, lr, norm_v))
        ended, took, us = t0 * 1e-9 + self.wall_offset, duration_ns * 1e-9, cost * 1e-3
        ring.append(step, ended, took, loss_f, lr_f, us, data_wait, name, micro, norm_f, traced, measured, s, t, waited)
        self._full_at = min(self._replicas.due, self.trace_pacing.hard_at, step + ring.room())
        self.memory.tick()
        self._keep_pending(row, loss_v, norm_v, lr)  # after the row: a query may fill it at once

    def _settle(self, t0: int, last: int) -> bool:
        """Charge the budget for the boundaries since it was last settled (this full one's
        predecessor and the quick ones after it, at ``_CHARGE`` times their own timing), credit
        the time their steps took, and say whether the next step may be measured."""
        since = self._settled_ns if self._settled_ns is not None else last
        n = max(0, self.step - self._settled_step - 1)  # quick boundaries since
        self._settled_step = self.step
        if n:
            self._quick_rate = _CHARGE * self._quick_ns / n / max(1, (t0 - since) / (n + 1))
        allowed = self.budget.tick(t0 - since, t0, _CHARGE * (self._spent + self._quick_ns), 1 + n)
        self._settled_ns = t0
        self._spent = self._quick_ns = 0
        return allowed

    def _plan_next(self, step: int, t0: int, traced: bool, measure: bool) -> int:
        """Set up the next step, measured or not (``measure``, from the budget): its backward calls and inputs
        noted or not, the tracer's turn, and whether the steps after it may take the quick path (``_quick_next``:
        none measured, explicit or traced). Returns the ns of a trace the user asked for (PROBE_TRACE set):
        shown in probe_us, not paced."""
        if measure is not self.capture.wanted:
            self.capture.note(measure)
        inputs = self.inputs
        if (inputs.counting is None) is measure and inputs.root is not None:
            inputs.count(measure)  # the inputs are counted on measured steps only
        tracer = self.tracer
        pacing = self.trace_pacing
        asked = pacing.turn(step, traced, measure, self.wall_offset) if pacing.wants_turn(step, traced, measure) else 0
        self._quick_next = not (
            measure or self.explicit or tracer.handles or tracer.pending_events or tracer.active_step is not None
        )
        return asked

    def _keep_pending(self, row: int, loss_v, norm_v, lr) -> None:
        """Device values (holders) of this row, read a few steps later or when a query asks."""
        if type(loss_v) is tuple or type(norm_v) is tuple or type(lr) is tuple:
            pending = self.pending
            if pending.keep(row, (("loss", loss_v), ("grad_norm", norm_v), ("lr", lr))) >= _RESOLVE_EVERY:
                pending.resolve(up_to_row=row - _LAG)

    def _occasional(self, step: int, frame, duration_ns: float, traced: bool) -> None:
        """Work a measured step does when it is due: discovery scans (steps 1, 2, 4, 8, ... or the first
        measured step after), and charging a traced step's hooks to the budget."""
        if step >= self._scan_due:
            self._scan_due = 2 * step
            try:
                finder.scan(frame)
                self.watch_roots()
            except Exception as exc:
                record_error("torch steps: discovery", exc)
        self.trace_pacing.charge(self.budget, duration_ns, traced)
