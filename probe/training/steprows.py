"""What a ``torch.steps`` row holds beyond the boundary's own values, and the rows of several optimizers.

* The columns (``COLUMNS``, the table's declaration): what the boundary writes per step (``RING_COLUMNS``, their
  dtypes from the declared SQL types), and those derived when a query asks (``snapshot``).
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
  backpropagate after it is that step's loss too (``add_late_loss``). Each optimizer step of a
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
from ..util.ring import Pending, Ring, landed
from ..util.wire import Column


# -- the columns -------------------------------------------------------------------------------------
# torch.steps' columns, in the table's order: the one declaration of their names, SQL types and descriptions
# (``probe.tables.torch`` registers the table with it, the ring's dtypes come from it).
COLUMNS = (
    Column("step", "BIGINT", "Step number, counted from 1 since the probe started."),
    Column("started_at", "TIMESTAMP", "When the step started (the end of the previous step)."),
    Column("ended_at", "TIMESTAMP", "When the step ended (its optimizer step returned)."),
    Column(
        "duration",
        "DOUBLE",
        "Wall-clock seconds from the previous step boundary to this one, data loading included. Step 1 runs "
        "from its first module call instead: its data loading is not in it, and the step-time medians "
        "(`ranks.latest`, `probe status`) leave it out.",
    ),
    Column(
        "loss",
        "DOUBLE",
        "The step's loss, on every step: the sum of the scalars the loop backpropagated in it (a CPU loss is "
        "read when backward is called on it, nothing of it kept; a device loss is kept detached, copied without "
        "blocking and filled in once the copy has landed: NULL means not ready yet), else on measured steps the "
        "loop's loss variable (PROBE_LOSS_NAMES) for loops that never backpropagate a scalar; NULL when none was "
        "found.",
    ),
    Column(
        "grad_norm",
        "DOUBLE",
        "Total gradient L2 norm, read lazily: clip_grad_norm_'s result (before clipping) when the loop clips, else "
        "the lead optimizer's gradients at its step, computed on enough steps to cost at most PROBE_GRAD_NORM "
        "(default 0.1 %) of the step time (NULL on the others); NULL on a step that was not measured. Per rank "
        "under FSDP2/DTensor: the norm of this rank's shards, computed without a collective (the model's norm is "
        "SQRT(SUM(grad_norm * grad_norm)) over the ranks at one step, see docs/torch.md).",
    ),
    Column("lr", "DOUBLE", "Learning rate of the lead optimizer's first param group used by this step."),
    Column(
        "samples_per_s",
        "DOUBLE",
        "Samples per second: batch dimension of the root model's training inputs (or probe.step(samples=)) over "
        "duration.",
    ),
    Column(
        "tokens_per_s",
        "DOUBLE",
        "Tokens per second: elements of integer inputs of rank 2 or more (or probe.step(tokens=)) over duration.",
    ),
    Column(
        "peak_allocated",
        "BIGINT",
        "Peak memory so far in bytes: the CUDA allocator's max_memory_allocated on GPU runs, else the process's "
        "peak RSS; from the reading nearest the step's end (see memory).",
    ),
    Column(
        "memory",
        "BIGINT",
        "Memory in use in bytes near the step's end, on every step: the CUDA allocator's memory_allocated on GPU "
        "runs, else the process's resident set size; read every 0.1 s by a thread of the probe's own (not the "
        "training thread) and joined to the step nearest in time, so steps shorter than 0.1 s share a reading; "
        "NULL with no reading within 1 s.",
    ),
    Column(
        "data_wait",
        "DOUBLE",
        "Seconds from the previous step's end to this step's first forward call of the primary model, on every "
        "step: loading the batch (plus zero_grad and moving it to the device); NULL before the primary model is "
        "found or when it had no forward call.",
    ),
    Column("rank", "INTEGER", "Global rank, NULL outside a distributed job."),
    Column("traced", "BOOLEAN", "Whether module tracing (python.torch_trace) was on during this step."),
    Column("samples", "DOUBLE", "Samples processed in this step; NULL when unknown or not measured (see measured)."),
    Column("tokens", "DOUBLE", "Tokens processed in this step; NULL when unknown or not measured (see measured)."),
    Column(
        "micro_batches",
        "BIGINT",
        "Training forward passes of the root model in this step (more than 1 under gradient accumulation); 0 when "
        "not measured.",
    ),
    Column("optimizer", "VARCHAR", "Class of the lead optimizer."),
    Column(
        "measured",
        "BOOLEAN",
        "Whether the probe measured this step's optional values (grad_norm, samples, tokens, micro_batches, "
        "cpu_wait, module traces): false on the steps it skipped to stay within PROBE_STEP_BUDGET, where those are "
        "NULL (micro_batches 0) because they were not measured. Which steps are measured is jittered so that it "
        "cannot follow a job's own period. step, durations, loss, lr, data_wait, memory, optimizer and traced are "
        "recorded on every step.",
    ),
    Column(
        "probe_us",
        "DOUBLE",
        "Microseconds the probe's own work took at this step's boundary (queued actions excluded): what "
        "PROBE_STEP_BUDGET paces (the row is written when the boundary ends).",
    ),
    Column(
        "cpu_wait",
        "DOUBLE",
        "Seconds per step the training thread was ready to run but waited for a CPU (the kernel's run-queue delay: "
        "other processes, data loader workers, a neighbour's job), averaged since the previous measured step; on "
        "measured steps only (Linux), else NULL. A step time that grows with it is the host's, not the job's.",
    ),
    Column(
        "compute",
        "DOUBLE",
        "Seconds of the step this rank spent on its own work (data, forward, backward) before it issued the step's "
        "last collective, from torch.collectives; NULL without a recorded collective in the step.",
    ),
    Column(
        "comm_wait",
        "DOUBLE",
        "Seconds from the step's last collective to its end: waiting for the other ranks (and the optimizer step); "
        "NULL without a recorded collective.",
    ),
)
# Those the boundary writes at every step, in the order it appends them: the ring's columns. The others are derived
# when a query asks (``snapshot``; compute and comm_wait by the table, from the recorded collectives). An unmeasured
# step's row ends after micro_batches: the rest are NULL (false) there.
_WRITTEN = ("step", "ended_at", "duration", "loss", "lr", "probe_us", "data_wait", "optimizer", "micro_batches")
_WRITTEN += ("grad_norm", "traced", "measured", "samples", "tokens", "cpu_wait")
_DTYPES = {"BIGINT": "i8", "INTEGER": "i8", "DOUBLE": "f8", "TIMESTAMP": "f8", "BOOLEAN": "b1", "VARCHAR": "O"}
_TYPES = {c.name: c.type for c in COLUMNS}
RING_COLUMNS = {name: _DTYPES[_TYPES[name]] for name in _WRITTEN}


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
            add_late_loss(tracker)
            cycle.taken = 0
    elif was is None and optimizer is not lead:
        # recognised just now, in an iteration whose lead step already ended a step: that step stands for the
        # iteration (no extra step); what was backpropagated since goes to this row and to that step's loss
        cycle.record(tracker, optimizer, t0, tracker.step)
        tracker.used_lr = None
        if closes:
            cycle.taken = 0
            add_late_loss(tracker)
    else:
        cycle.record(tracker, optimizer, t0, tracker.step + 1)
        tracker.used_lr = None
        if closes:
            cycle.taken = 0
            tracker.boundary(lead if lead is not None else optimizer, tracker.loop_frame(), t0=t0)
    tracker.full_next()  # every optimizer step comes here, the lead's included


def add_late_loss(tracker) -> None:
    """Add what was backpropagated since the last boundary to the loss of the row it wrote: with several
    optimizers, the loss of one that steps after the lead in the iteration the lead's step ended. A CPU
    value is added at once, a device value once its copy has landed (never by waiting for the device)."""
    try:
        late = tracker.capture.take()
    except Exception as exc:  # the row keeps the loss it has
        record_error("torch steps: loss", exc)
        return
    ring, pending = tracker.ring, tracker.pending
    row = ring.count - 1
    if late is None or row < 0:
        return
    if type(late) is tuple or pending.waits(row, "loss"):
        pending.keep(row, (("loss", late if type(late) is tuple else landed(late)),), add=True)
    else:
        ring.set("loss", row, late + (ring.get("loss", row) or 0.0))
