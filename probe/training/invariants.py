"""Invariant checks of training: relations that hold in every correct run, checked on measured steps (each at
about the cost of a few attribute reads) and recorded in ``torch.checks``, one row per check and measured step,
for the doctor's rules to read; docs/doctor.md says what each check (``grads_present``, ``grads_reach``,
``grads_cleared``, ``accumulation``, ``backward_once``, ``params_move``, ``frozen_still``, ``schedule``,
``train_mode``) finds and why. Nothing here raises into the training loop: errors go to ``probe.errors``.
"""

from __future__ import annotations

import itertools
import time
import weakref

from . import finder
from .._core.boundary import boundary
from .weights import Updates, grouped
from ..config import setting
from ..util.errorlog import record_error
from ..util.ring import Ring


CHECK_COLUMNS = {"step": "i8", "time": "f8", "invariant": "O", "ok": "b1", "subject": "O", "value": "f8", "detail": "O"}
_REFRESH_MAX = 500  # steps between refreshes of the cached targets at most (they double from step 1 until then)
_NAMES_SHOWN = 5
_RETRY = 8  # steps between looks for the trained model while none is known
_PENDING_MAX = 4  # device reads one grads_cleared window keeps at most
_WINDOW_STEPS = 2  # optimizer steps whose backward passes one grads_cleared window looks at
_REACH_MAX = 4096  # trainable tensors grads_reach looks at, at most
_PER_STEP = ("OneCycleLR", "CyclicLR")  # schedulers whose schedule counts optimizer steps
_LOOK_EVERY = 8  # steps between looks for a scheduler while none is known
_PACE_STEPS = 30  # optimizer steps before a scheduler's pace is judged


def _trainable(optimizer):
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                yield p


class _GradWatch:
    """One tensor hook on one parameter, from one measured boundary to the next."""

    __slots__ = ("param", "name", "since", "until", "clock", "fired", "clear", "clears", "pending", "handle", "torch")

    def __init__(self, torch, param, name: str, since: int, clock=None):
        self.torch = torch
        self.param = weakref.ref(param)
        self.name = name
        self.since = since
        self.until = None  # the step the window closed at (``_WINDOW_STEPS`` after ``since``); None while open
        self.clock = clock  # the number of optimizer steps taken so far (the step tracker's), or None
        self.fired = 0
        self.clear = False
        self.clears = 0  # backward passes that found the gradient None or zero (CPU only)
        self.pending: list = []
        self.handle = param.register_hook(self._on_grad)

    def _on_grad(self, grad):
        if self.until is not None:
            return None  # the window is closed: nothing to look at until the next measured boundary
        try:
            clock = self.clock
            if clock is not None:
                now = clock()
                if now - self.since >= _WINDOW_STEPS:  # the first backward after the window's steps
                    self.until = now
                    boundary.after_step(self._unhook)  # else it would run at every backward until the next check
                    return None
            self.fired += 1
            p = self.param()
            if self.clear:
                if p is not None and not p.is_cuda and (p.grad is None or not p.grad.any()):
                    self.clears += 1
                return None
            g = None if p is None else p.grad
            if g is not None and type(g) is not self.torch.Tensor and hasattr(g, "to_local"):
                g = g.to_local()  # a DTensor's shard: reducing the whole tensor would be a collective
            if g is None:
                self.clear = True
                self.clears += 1
            elif g.is_cuda:
                if len(self.pending) < _PENDING_MAX:
                    zero = self.torch.count_nonzero(g) == 0
                    host = self.torch.empty((), dtype=self.torch.bool, pin_memory=True)
                    host.copy_(zero, non_blocking=True)
                    ev = self.torch.cuda.Event()
                    ev.record()
                    self.pending.append((host, ev))
            elif not g.any():
                self.clear = True
                self.clears += 1
        except Exception as exc:
            record_error("torch checks: gradient hook", exc)
        return None

    def verdict(self):
        """True (cleared at some backward), False (never), or None (no backward yet, or a device read pending)."""
        if self.fired == 0:
            return None
        if self.clear:
            return True
        for host, ev in self.pending:
            if not ev.query():
                return None
            if bool(host.item()):
                return True
        return False

    def _unhook(self, event) -> None:
        """The boundary after the window closed: the hook goes out (its counts stay for the verdict)."""
        boundary.remove(self._unhook)
        self.remove()

    def remove(self) -> None:
        try:
            self.handle.remove()
        except Exception:
            pass


class _Pace:
    """The ``schedule`` check: the lead optimizer's LR scheduler keeps its declared pace."""

    def __init__(self):
        self._opt = None  # weakref to the lead optimizer
        self._sched = None  # weakref to its scheduler
        self._sched_base = None  # (step, last_epoch) when it was first seen
        self._look_at = 0  # the step of the next look for a scheduler while none is known

    def refresh(self, optimizer) -> None:
        if self._opt is None or self._opt() is not optimizer:
            self._opt = weakref.ref(optimizer)
            self._sched = self._sched_base = None
        self._find_scheduler()

    def _find_scheduler(self, step: int | None = None):
        """The scheduler of the optimizer the targets were picked for: among those found so far, and every
        ``_LOOK_EVERY`` steps (``step`` given) after a look at __main__'s globals and the frameworks' objects."""
        opt = self._opt() if self._opt is not None else None
        if opt is None:
            return None
        inner, _ = finder.unwrap_optimizer(opt)
        look = step is not None and step >= self._look_at
        if look:
            self._look_at = step + _LOOK_EVERY
        for f in finder.schedulers() if look else finder.known("scheduler"):
            o = getattr(f.obj, "optimizer", None)
            if o is not None and finder.unwrap_optimizer(o)[0] is inner:
                if self._sched is None or self._sched() is not f.obj:  # the same one keeps its count
                    self._sched = weakref.ref(f.obj)
                    self._sched_base = None
                return f.obj
        return None

    def check(self, step, now, record) -> None:
        sched = self._sched() if self._sched is not None else None
        if sched is None:
            sched = self._find_scheduler(step)  # one made after the optimizer (a stage's own)
            if sched is None:
                return
        last = getattr(sched, "last_epoch", None)
        if type(last) is not int:
            return
        if self._sched_base is None:
            self._sched_base = (step, last)
            return
        s0, l0 = self._sched_base
        steps, stepped = step - s0, last - l0
        kind = type(sched).__name__
        times = f"{stepped} times in {steps} optimizer steps"
        problem = None
        if stepped > steps + 1 and steps >= 10:
            problem = (
                f"{kind} stepped {times}: more often than its optimizer (per batch and per epoch, or twice a step?)"
            )
        elif steps >= _PACE_STEPS and stepped * 4 < steps and self._per_step(sched):
            total = getattr(sched, "total_steps", None)
            horizon = f"total_steps={total}" if total is not None else "its schedule is in optimizer steps"
            problem = (
                f"{kind} counts optimizer steps ({horizon}) but stepped {times}: it is stepped once an epoch, so its "
                "schedule hardly moves (warm-up never ends)"
            )
        elif kind == "CosineAnnealingLR" and last > getattr(sched, "T_max", last) and stepped * 2 > steps:
            problem = (
                f"CosineAnnealingLR is at step {last}, past its T_max={sched.T_max}, where its rate climbs back up "
                f"(stepped {times}: stepped per batch while T_max counts epochs?)"
            )
        record(step, now, "schedule", problem is None, kind, float(stepped) / steps if steps else None, problem)

    @staticmethod
    def _per_step(sched) -> bool:
        if type(sched).__name__ in _PER_STEP:
            return True
        fns = getattr(sched, "lr_lambdas", None) or []  # transformers' schedules: partials of *_with_warmup_lr_lambda
        return any("warmup" in getattr(getattr(fn, "func", fn), "__name__", "") for fn in fns)


class Invariants:
    def __init__(self, torch):
        self.torch = torch
        self.ring = Ring(CHECK_COLUMNS, setting("PROBE_STEPS_CAPACITY"))
        self._refresh_at = 1
        self._retry_at = 1
        self._names: dict = {}  # id(param) -> name, of the trained model
        self._modes: list = []  # (name, module) of its dropout and normalization modules
        self._watch: _GradWatch | None = None
        self._pick = None  # weakref to the parameter grads_cleared watches
        self._clock = None  # the step tracker's count of optimizer steps (at_boundary's clock)
        self._model = None  # weakref to the trained model
        self._opt = None  # weakref to the optimizer the targets were picked for
        self._single = True  # one optimizer found (the accumulation check needs it)
        self.updates = Updates(torch)
        self.pace = _Pace()

    # -- the one call from the step boundary ---------------------------------------------------------------
    def at_boundary(self, step: int, optimizer, capture=None, clock=None) -> None:
        """Check the invariants at a measured step's boundary (the lead optimizer just stepped); ``capture``
        holds the step's backward calls, ``clock()`` gives the optimizer steps taken so far."""
        if optimizer is None:
            return
        self._clock = clock
        try:
            lost = self._model is None or self._model() is None  # not found yet (a scan finds it), or gone
            if (
                step >= self._refresh_at
                or self._opt is None
                or self._opt() is not optimizer
                or (lost and step >= self._retry_at)
            ):
                self._refresh_at = step + min(step, _REFRESH_MAX)
                self._retry_at = step + _RETRY
                self._refresh(optimizer)
            now = time.time()
            self._grads_present(step, now, optimizer)
            self._grads_reach(step, now, optimizer)
            self._grads_cleared(step, now, optimizer)
            self._train_mode(step, now)
            if capture is not None:
                self._backward_once(step, now, capture)
            model = self._model() if self._model is not None else None
            if model is not None:
                self.updates.check(step, now, self._record)
                try:
                    self.pace.check(step, now, self._record)
                except Exception as exc:
                    record_error("torch checks: scheduler pace", exc)
        except Exception as exc:
            record_error("torch checks", exc)

    def _record(self, step, now, check, ok, subject, value, detail) -> None:
        self.ring.append(step, now, check, ok, subject, value, detail)

    # -- targets -----------------------------------------------------------------------------------------------
    def _refresh(self, optimizer) -> None:
        """The model holding the optimizer's first tensor, its parameter names and its dropout/norm modules."""
        self._opt = weakref.ref(optimizer)
        self._single = len(finder.optimizers()) <= 1
        groups = optimizer.param_groups
        first = groups[0]["params"][0] if groups and groups[0]["params"] else None
        if first is None:
            return
        self._model = None
        for found in finder.models():
            model = found.obj
            names = {id(p): finder.module_path(n) for n, p in model.named_parameters()}
            if id(first) not in names:
                continue
            self._names = names
            self._model = weakref.ref(model)
            self._modes = [(finder.module_path(n), m) for n, m in model.named_modules() if self._mode_matters(m)]
            self.updates.refresh(model, optimizer)
            self.pace.refresh(optimizer)
            return

    def _mode_matters(self, m) -> bool:
        nn = self.torch.nn
        if isinstance(m, nn.modules.dropout._DropoutNd):
            return m.p > 0
        if isinstance(m, (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)):
            if not isinstance(m, nn.modules.batchnorm._NormBase):
                return False  # layer and group norm behave the same in both modes
            own = list(m.parameters(recurse=False))
            return not own or any(p.requires_grad for p in own)  # a frozen batch norm in eval mode is on purpose
        return False

    # -- the checks ----------------------------------------------------------------------------------------------
    def _grads_present(self, step, now, optimizer) -> None:
        first = None
        for p in _trainable(optimizer):  # the first tensor with a gradient ends the search
            if first is None:
                first = p
            if p.grad is not None:
                self._record(step, now, "grads_present", True, self._names.get(id(first), "?"), None, None)
                return
        if first is not None:
            n = sum(1 for _ in _trainable(optimizer))
            self._record(
                step,
                now,
                "grads_present",
                False,
                self._names.get(id(first), "?"),
                float(n),
                f"none of the {n} trainable tensors held a gradient at the step",
            )

    def _grads_reach(self, step, now, optimizer) -> None:
        names, every, missing = self._names, [], []
        for p in itertools.islice(_trainable(optimizer), _REACH_MAX):
            name = names.get(id(p))
            if name is not None:
                every.append(name)
                if p.grad is None:
                    missing.append(name)
        if not every or len(missing) == len(every):
            return  # no gradient at all: grads_present's finding, not this one's
        self._record(
            step,
            now,
            "grads_reach",
            not missing,
            grouped(missing, every) if missing else None,
            float(len(missing)),
            f"{len(missing)} of the {len(every)} trainable tensors held no gradient at the step" if missing else None,
        )

    def _grads_cleared(self, step, now, optimizer) -> None:
        watch = self._watch
        if watch is not None and (watch.param() is None or not any(p is watch.param() for p in _trainable(optimizer))):
            watch.remove()  # its tensor is gone or left the optimizer (a new stage's model): watch another
            self._watch = watch = None
            self._pick = None
        if watch is not None:
            if watch.fired == 0:
                return  # no backward since it was armed: keep waiting
            verdict = watch.verdict()
            if verdict is None and step - watch.since <= 64:
                return  # a device read still pending
            watch.remove()
            self._watch = None
            if verdict is not None:
                self._record(
                    step,
                    now,
                    "grads_cleared",
                    verdict,
                    watch.name,
                    float(watch.fired),
                    f"{watch.fired} backward pass(es) from step {watch.since} to step {step}"
                    + ("" if verdict else ", the gradient never None or zero before any of them"),
                )
            steps = (watch.until or step) - watch.since
            if verdict is not None and self._single and steps > 0 and not watch.pending:
                # one row a window (ok without accumulation), so a finding ends with the accumulation that caused it
                erased = verdict and watch.fired > steps and watch.clears >= watch.fired
                self._record(
                    step,
                    now,
                    "accumulation",
                    not erased,
                    watch.name,
                    float(watch.fired) / steps,
                    f"{watch.fired} backward passes in {steps} optimizer step(s) (steps {watch.since + 1}-{step}) and "
                    "the gradient "
                    f"was cleared before each of them: only the last micro-batch of each step counts"
                    if erased
                    else None,
                )
        pick = self._pick() if self._pick is not None else None
        if pick is None or pick.grad is None or not pick.requires_grad:
            candidates = [
                p for p in itertools.islice(_trainable(optimizer), 64) if p.grad is not None and id(p) in self._names
            ]
            if not candidates:
                return
            pick = min(candidates, key=lambda p: p.numel())
            self._pick = weakref.ref(pick)
        self._watch = _GradWatch(self.torch, pick, self._names.get(id(pick), "?"), step, self._clock)

    def _backward_once(self, step, now, capture) -> None:
        n, repeated, graph = capture.take_backwards()
        if not n:
            return
        self._record(
            step,
            now,
            "backward_once",
            not repeated,
            graph,
            float(n),
            f"{n} backward calls in step {step}, {repeated} of them through a graph already backpropagated in the step "
            f"(the loss behind {graph})"
            if repeated
            else None,
        )

    def _train_mode(self, step, now) -> None:
        modes = self._modes
        if not modes:
            return
        off = [name for name, m in modes if not m.training]
        shown = ", ".join(off[:_NAMES_SHOWN]) + (
            f" and {len(off) - _NAMES_SHOWN} more" if len(off) > _NAMES_SHOWN else ""
        )
        types = sorted({type(m).__name__ for _, m in modes if not m.training})
        self._record(
            step,
            now,
            "train_mode",
            not off,
            shown or None,
            float(len(off)),
            f"{len(off)} of {len(modes)} dropout/batch-norm modules in eval mode ({', '.join(types)})" if off else None,
        )

    # -- the table -------------------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return self.ring.snapshot()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None


_instance: list = []


def checks(torch=None) -> Invariants | None:
    """The process's Invariants (made on the first call that passes torch), or None before that."""
    if not _instance and torch is not None:
        _instance.append(Invariants(torch))
    return _instance[0] if _instance else None
