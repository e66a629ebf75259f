"""What a ``torch.steps`` row holds beyond the boundary's own values, and the rows of several optimizers.

* The columns (``STEP_COLUMNS``): what the boundary writes per step (``RING_COLUMNS``), and those derived when a
  query asks (``snapshot``).
* ``Pending``: device values copied off the device without blocking (a pinned host copy and an event,
  ``Capture.hold``), read into their rows once the copy has landed, never by waiting for the device.
* ``MemoryClock``: every step's memory reading, at no cost to the training thread. A daemon thread reads the
  process's memory every ``PERIOD`` seconds while steps come (once a second while none do): on a CUDA run the
  caching allocator's ``memory_allocated`` and ``max_memory_allocated`` of the training thread's device (host-side
  counters: no device sync), else the resident set size and the peak RSS. ``snapshot`` joins each step to the
  reading nearest its end (``MemoryClock.at``); a step with no reading within ``JOIN_S`` of its end has NULL.
* ``OptimizerCycle``: several optimizers in one iteration (a GAN's discriminator and generator, a separate
  embedding optimizer): which optimizer step ends a training step, and each one's loss.
  A job with one optimizer never comes here: the step tracker hands optimizer steps over once a second
  optimizer has stepped (``see``). The sequence is periodic: ``D G D G ...``, or ``D D D D D G`` for a WGAN's five
  critic steps per generator step. Once the last ``2 * period`` steps are two copies of one period (of at least two
  optimizers), the iteration is recognised: it starts with a step of the first optimizer seen stepping (the lead)
  that follows another optimizer's step. The tracker then closes a training step after the iteration's last
  optimizer step, so a step holds every optimizer's work and actions never run between them; a step that breaks
  the cycle drops it. Without a recognised iteration, the lead's step ends a training step and what the others
  backpropagate after it is that step's loss too (``StepTracker.add_late_loss``). Each optimizer step of a
  recognised iteration is a row of ``torch.optimizer_steps`` (``rows``): its position, the optimizer, the loss
  backpropagated since the previous optimizer step, the lr it used and (measured steps) its gradient norm.
"""

from __future__ import annotations

import resource
import threading
import time
import weakref

from ..config import setting
from ..util.errorlog import record_error
from ..util.procfs import RssReader
from ..util.ring import Ring


# -- the columns -------------------------------------------------------------------------------------
# torch.steps' columns, each once: the ring's dtype of those the boundary writes (in the order it appends them), or
# None for those derived from them when a query asks (``snapshot``) rather than at every boundary.
STEP_COLUMNS = {
    "step": "i8",
    "ended_at": "f8",
    "duration": "f8",
    "loss": "f8",
    "grad_norm": "f8",
    "lr": "f8",
    "traced": "b1",
    "measured": "b1",
    "samples": "f8",
    "tokens": "f8",
    "micro_batches": "i8",
    "optimizer": "O",
    "cpu_wait": "f8",
    "probe_us": "f8",
    "data_wait": "f8",
    "started_at": None,
    "samples_per_s": None,
    "tokens_per_s": None,
    "peak_allocated": None,
    "memory": None,
    "rank": None,
}
RING_COLUMNS = {name: dtype for name, dtype in STEP_COLUMNS.items() if dtype is not None}


def snapshot(tracker) -> dict:
    """The ``torch.steps`` columns of ``tracker`` (a ``StepTracker``), oldest step first: the ring's, and those
    derived from them."""
    import numpy as np

    tracker.pending.resolve()
    cols = tracker.ring.snapshot()
    ended, duration = cols["ended_at"], cols["duration"]
    with np.errstate(divide="ignore", invalid="ignore"):
        per_s = np.ma.masked_where(duration <= 0, 1.0 / duration)  # NULL, not NaN, for a step of no length
    cols["memory"], cols["peak_allocated"] = tracker.memory.at(ended)
    cols["started_at"] = ended - duration
    cols["samples_per_s"] = cols["samples"] * per_s
    cols["tokens_per_s"] = cols["tokens"] * per_s
    cols["rank"] = np.full(len(ended), np.nan if tracker.rank is None else float(tracker.rank))
    return cols


# -- device values read once they have landed --------------------------------------------------------
def read(holder):
    """The value behind a holder from ``Capture.hold``, or None while its device copy has not landed."""
    host, ev = holder
    if ev is not None and not ev.query():
        return None
    return float(host.item())


class _OnHost(float):
    """A value already on the host, in a holder's place (``landed``)."""

    def item(self) -> float:
        return float(self)


def copy_off(torch, t) -> tuple:
    """``(pinned host copy, event)`` of device tensor ``t`` (of a host one: itself), copied without blocking: read the
    copy once the event has completed."""
    host = t
    if t.is_cuda:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return host, ev


def landed(value: float) -> tuple:
    """A holder whose value has landed already: a host value that must wait in line behind device values."""
    return (_OnHost(value), None)


class Pending:
    """Holders of a ring's rows whose device values have not landed yet: kept at a boundary (``keep``),
    read into their rows once ready (``resolve``: a few steps later on the training thread, or when a
    query asks). A row the ring has since overwritten is dropped."""

    __slots__ = ("ring", "what", "items", "_lock")

    def __init__(self, ring, what: str):
        self.ring, self.what = ring, what
        self.items: list = []  # (ring row, column, holder)
        self._lock = threading.Lock()

    def keep(self, row: int, values, add: bool = False) -> int:
        """Keep the holders among ``values`` (``(column, value)`` pairs) for ``row``; returns how many wait.
        ``add``: each value is added to the cell once read (after the values kept for that cell before it)."""
        with self._lock:
            for col, v in values:
                if type(v) is tuple:
                    self.items.append((row, col, v, add))
            return len(self.items)

    def waits(self, row: int, col: str) -> bool:
        """Whether a value of ``row``'s ``col`` has not landed yet."""
        with self._lock:
            return any(r == row and c == col for r, c, _, _ in self.items)

    def resolve(self, up_to_row: int | None = None) -> None:
        """Read the values that have landed (of rows up to ``up_to_row`` if given) into their rows."""
        ring = self.ring
        with self._lock:
            keep = []
            for item in self.items:
                row, col, holder, add = item
                if ring.count - row > ring.capacity:
                    continue
                if (up_to_row is not None and row > up_to_row) or (
                    add and any(r == row and c == col for r, c, _, _ in keep)  # what it adds to has not landed
                ):
                    keep.append(item)
                    continue
                try:
                    v = read(holder)
                except Exception as exc:
                    record_error(f"{self.what}: reading {col}", exc)
                    continue
                if v is None:
                    keep.append(item)
                    continue
                if add:
                    v += ring.get(col, row) or 0.0
                ring.set(col, row, v)
            self.items = keep


# -- the memory clock --------------------------------------------------------------------------------
PERIOD = 0.1  # seconds between readings while steps come
IDLE_PERIOD = 1.0  # ... and while none do
JOIN_S = 1.0  # a step takes the reading nearest its end when one is this close
CAPACITY = 36_000  # an hour of readings at PERIOD


class MemoryClock:
    def __init__(self, torch, steps=lambda: 0):
        self.torch = torch
        self.steps = steps  # the tracker's step count: the clock reads faster while it moves
        self.ring = Ring({"at": "f8", "memory": "f8", "peak": "f8"}, CAPACITY)
        self.device = None  # the training thread's CUDA device index, once CUDA is in use
        self._thread = None
        self._stop = threading.Event()
        self._rss = None
        self._failed = False

    def tick(self) -> None:
        """At a full step boundary (training thread): start the clock, and note the CUDA device in use."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(self._stop,), name="probe-memory", daemon=True)
            self._thread.start()
        if self.device is None:
            try:
                cuda = self.torch.cuda
                if cuda.is_initialized():
                    self.device = cuda.current_device()
            except Exception as exc:
                record_error("torch memory clock: the CUDA device", exc)

    def read(self) -> None:
        """One reading into the ring (the clock's thread, or a test)."""
        device = self.device
        if device is not None:
            cuda = self.torch.cuda
            memory = float(cuda.memory_allocated(device))
            peak = float(cuda.max_memory_allocated(device))
        else:
            if self._rss is None:
                self._rss = RssReader()
            memory = self._rss()
            peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        self.ring.append(time.time(), memory, peak)

    def _run(self, stop: threading.Event) -> None:
        last = None
        wait = 0.0
        while not stop.wait(wait):
            try:
                self.read()
            except Exception as exc:
                if not self._failed:
                    self._failed = True
                    record_error("torch memory clock", exc)
            step = self.steps()
            wait = PERIOD if step != last else IDLE_PERIOD
            last = step

    def stop(self) -> None:
        """Stop the clock thread (the probe paused or closed); the next ``tick`` starts a new one."""
        self._stop.set()
        self._stop = threading.Event()
        self._thread = None

    def at(self, ended_at):
        """(in use, peak) for steps ending at ``ended_at`` (wall seconds, ascending): each the reading
        nearest the step's end within ``JOIN_S``, else missing (masked arrays)."""
        import numpy as np

        cols = self.ring.snapshot()
        at = np.asarray(cols["at"], dtype="f8")
        n = len(ended_at)
        if not len(at) or not n:
            empty = np.ma.masked_all(n, dtype="f8")
            return empty, empty.copy()
        ends = np.asarray(ended_at, dtype="f8")
        right = np.clip(np.searchsorted(at, ends), 0, len(at) - 1)
        left = np.clip(right - 1, 0, len(at) - 1)
        nearest = np.where(np.abs(at[left] - ends) <= np.abs(at[right] - ends), left, right)
        far = np.abs(at[nearest] - ends) > JOIN_S
        memory = np.ma.masked_array(np.asarray(cols["memory"], dtype="f8")[nearest], mask=far)
        peak = np.ma.masked_array(np.asarray(cols["peak"], dtype="f8")[nearest], mask=far)
        return memory, peak


# -- several optimizers ------------------------------------------------------------------------------
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


def cycle_step(tracker, optimizer, t0: int) -> None:
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
