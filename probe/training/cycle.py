"""Several optimizers in one iteration (a GAN's discriminator and generator, a separate
embedding optimizer): which optimizer step ends a training step, and each one's loss.

A job with one optimizer never comes here: the step tracker hands an optimizer step over
only once a second optimizer has stepped. From then on every optimizer step is noted
(``see``). The sequence of steps is periodic in a training loop: ``D G D G ...``, or ``D D D
D D G`` for a WGAN's five critic steps per generator step. Once the last ``2 * period``
steps are two copies of one period (of at least two different optimizers), the iteration is
recognised: it starts with a step of the first optimizer seen stepping (the lead, unless
``probe.watch`` named one that had not stepped yet) that follows another optimizer's step, and
ends with the step before that one. The tracker then
closes a training step after the iteration's last optimizer step, so a step holds every
optimizer's work, and actions (which run at the boundary) never run between them. A step
that breaks the cycle (the generator stops training, a loop changes its schedule) drops it:
the lead's steps end training steps again until a cycle is seen again. Without a recognised
iteration, the lead's step starts an iteration and ends a training step: what the other
optimizers backpropagate after it is that step's loss too (``StepTracker.add_late_loss``).

Each optimizer step of a recognised iteration is also one row of ``torch.optimizer_steps``
(``rows``): its position in the iteration, the optimizer, the loss backpropagated since the
previous optimizer step (on every step: what ``Capture`` noted), the lr it used, and its
gradient norm (on measured steps, within the gradient norm's budget, PROBE_GRAD_NORM).
"""

from __future__ import annotations

import time
import weakref

from ..config import setting
from ..util.errorlog import record_error
from ..util.ring import Ring
from .pending import Pending

__all__ = ["OptimizerCycle", "CYCLE_COLUMNS"]

CYCLE_COLUMNS = {
    "step": "i8",
    "position": "i8",
    "optimizer_id": "i8",
    "optimizer": "O",
    "ended_at": "f8",
    "loss": "f8",
    "lr": "f8",
    "grad_norm": "f8",
}
_MAX_PERIOD = 16  # optimizer steps in one iteration, at most


class OptimizerCycle:
    """The optimizer-step sequence once several optimizers step: the recognised iteration, if any."""

    def __init__(self, first, stepped: bool):
        """``first``: the first optimizer seen stepping, where an iteration starts; ``stepped``: whether its
        step was already seen (the lead's, before a second optimizer stepped), else the next ``see`` is it."""
        self.anchor = id(first)
        self.refs: dict[int, weakref.ref] = {id(first): weakref.ref(first)}
        self.history: list[int] = [id(first)] if stepped else []  # ids of the last optimizer steps, newest last
        self.cycle: tuple | None = None  # the iteration's optimizer ids, lead first
        self.pos = 0  # position in ``cycle`` of the last step seen
        self.rows = Ring(CYCLE_COLUMNS, setting("PROBE_STEPS_CAPACITY"))
        self.taken = 0  # loss tensors the capture had noted at the last optimizer step (its list's length)
        self.pending = Pending(self.rows, "torch steps, one of several optimizers")  # read when a query asks

    @property
    def period(self) -> int:
        return len(self.cycle) if self.cycle is not None else 0

    def see(self, opt) -> bool | None:
        """Note a step of ``opt``. True: it ends an iteration; False: the iteration goes on; None:
        no iteration is recognised (the lead's steps end training steps)."""
        key = id(opt)
        if key not in self.refs:
            self.refs[key] = weakref.ref(opt)
        cycle = self.cycle
        if cycle is not None:
            nxt = (self.pos + 1) % len(cycle)
            if cycle[nxt] == key:
                self.pos = nxt
                return nxt == len(cycle) - 1
            self.cycle = None  # broken: start over from this step
            self.history = []
        history = self.history
        history.append(key)
        if len(history) > 2 * _MAX_PERIOD:
            del history[0]
        self._recognise()
        if self.cycle is None:
            return None
        return self.pos == len(self.cycle) - 1

    def _recognise(self) -> None:
        h = self.history
        for p in range(2, len(h) // 2 + 1):
            last = h[-p:]
            if last != h[-2 * p : -p] or len(set(last)) < 2 or self.anchor not in last:
                continue
            # the iteration starts at a lead step that follows another optimizer's step
            starts = [i for i in range(p) if last[i] == self.anchor and last[i - 1] != self.anchor]
            if not starts:
                continue
            s = starts[0]
            self.cycle = tuple(last[s:] + last[:s])
            self.pos = (p - 1 - s) % p  # where the newest step (last[-1]) falls in the iteration
            return

    def optimizer(self, key: int):
        ref = self.refs.get(key)
        return ref() if ref is not None else None

    def record(self, tracker, opt, t0: int, step: int) -> None:
        """``opt``'s row for the training step in progress: the loss backpropagated since the previous
        optimizer step, the lr it used, and its gradient norm (on a measured step)."""
        capture = tracker.capture
        loss = norm = None
        losses = capture.losses  # noted on every step: the loss is a core signal, as in torch.steps
        mine = losses[self.taken :]
        self.taken = len(losses)
        try:
            if mine:
                loss = capture.hold(mine[0] if len(mine) == 1 else capture.total(mine))
        except Exception as exc:
            record_error("torch steps: loss", exc)
        if capture.wanted:
            budget = tracker.norm_budget  # paced like the step's own norm (PROBE_GRAD_NORM)
            if budget.allows(t0):
                try:
                    t1 = time.perf_counter_ns()
                    norm = capture.hold(capture.grad_norm(opt))
                    budget.spend(time.perf_counter_ns() - t1)
                except Exception as exc:
                    record_error("torch steps: grad norm", exc)
        used = tracker.used_lr
        if used is not None and used[0] is opt:
            lr = used[1]
        else:
            try:
                lr = capture.hold(opt.param_groups[0]["lr"])
            except Exception:
                lr = None
        ring = self.rows
        row = ring.count
        ring.append(
            step,
            self.pos,
            id(opt),
            type(opt).__name__,
            t0 * 1e-9 + tracker.wall_offset,
            loss if type(loss) is float else None,
            lr if type(lr) is float else None,
            norm if type(norm) is float else None,
        )
        if type(loss) is tuple or type(lr) is tuple or type(norm) is tuple:
            self.pending.keep(row, (("loss", loss), ("lr", lr), ("grad_norm", norm)))

    def snapshot(self) -> dict:
        """The ring's columns, device values read where they have landed."""
        self.pending.resolve()
        return self.rows.snapshot()


def on_step(tracker, optimizer, t0: int) -> None:
    """A step of any optimizer once several have stepped: end the training step after the
    iteration's last optimizer step (or, with no iteration recognised, after the lead's)."""
    cycle = tracker.cycle
    was = cycle.cycle
    closes = cycle.see(optimizer)
    lead = tracker.lead_optimizer()
    if closes is None:
        tracker.used_lr = None
        if optimizer is lead:
            tracker.boundary(optimizer, tracker.loop_frame(), t0=t0)
        elif lead is not None and cycle.anchor == id(lead):
            # the lead's step, which starts the iteration, ended the training step: what this optimizer
            # backpropagated since is that step's too (not the next one's)
            tracker.add_late_loss()
            cycle.taken = 0
    elif was is None and optimizer is not lead:
        # recognised just now, in an iteration whose lead step already ended a step: that step stands for the
        # iteration (no extra step); what was backpropagated since goes to this row and to that step's loss
        cycle.record(tracker, optimizer, t0, tracker.step)
        tracker.used_lr = None
        if closes:
            cycle.taken = 0
            tracker.add_late_loss()
    else:
        cycle.record(tracker, optimizer, t0, tracker.step + 1)
        tracker.used_lr = None
        if closes:
            cycle.taken = 0
            tracker.boundary(lead if lead is not None else optimizer, tracker.loop_frame(), t0=t0)
    tracker.full_next()  # every optimizer step comes here, the lead's included
