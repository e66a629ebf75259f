"""What the optimizer steps changed, checked on measured steps for ``torch.checks`` (``probe.training.invariants``
calls these at its boundary):

* ``params_move``: a sample of the trained model's tensors that an optimizer holds, requires_grad, with a
  gradient at the step whose plain update (lr x grad) is well above the float's resolution at their value,
  changed since the last measured step. One that did not is held by an optimizer that never steps, or one whose
  update is skipped.
* ``frozen_still``: a sample of the tensors an optimizer holds with ``requires_grad=False`` did not change: a
  frozen tensor that moves is moved by momentum or weight decay on a stale zero gradient (frozen after the
  optimizer was built, its gradient zeroed instead of set to None).
* ``schedule``: the lead optimizer's LR scheduler keeps its declared pace: stepped no more often than its
  optimizer; a scheduler whose schedule counts optimizer steps (OneCycleLR, CyclicLR, a transformers
  warm-up schedule) stepped about once per optimizer step, not once an epoch; a CosineAnnealingLR stepped about
  once per optimizer step not past its T_max (where its rate climbs back up: stepped per batch with T_max in
  epochs).

The samples are a few elements of at most ``_SAMPLE`` tensors each (evenly spread over the model), compared
on the tensor's device; on CUDA the verdict is copied to the host without blocking and read at the next
measured step. Names are the model's own, grouped by module prefix.
"""

from __future__ import annotations

import weakref

from . import finder
from ..util.errorlog import record_error

__all__ = ["Updates", "grouped"]

_SAMPLE = 12  # tensors of each kind (trainable, frozen) watched
_ELEMENTS = 16  # elements read of each
_PER_STEP = ("OneCycleLR", "CyclicLR")  # schedulers whose schedule counts optimizer steps
_LOOK_EVERY = 8  # steps between looks for a scheduler while none is known
_PACE_STEPS = 30  # optimizer steps before a scheduler's pace is judged
_NAMES_SHOWN = 5
_RESOLUTION = 1e-5  # an update smaller than this fraction of the value may round away (float32's is ~1e-7)


def grouped(hit: list, every: list) -> str:
    """``hit`` (dotted tensor names) under the largest module prefixes of ``every`` that hold only hit ones.

    >>> grouped(["enc.0.weight", "enc.0.bias", "enc.1.weight"],
    ...         ["enc.0.weight", "enc.0.bias", "enc.1.weight", "head.weight"])
    'enc.* (3 tensors)'
    >>> grouped(["enc.0.weight", "head.weight"], ["enc.0.weight", "enc.0.bias", "head.weight"])
    'enc.0.weight, head.weight'
    """
    hit_set = set(hit)
    count: dict = {}
    pure: dict = {}
    for name in every:
        parts = name.split(".")
        for k in range(1, len(parts)):
            prefix = ".".join(parts[:k])
            count[prefix] = count.get(prefix, 0) + 1
            pure[prefix] = pure.get(prefix, True) and name in hit_set
    labels, seen = [], set()
    for name in hit:
        parts = name.split(".")
        label = name
        for k in range(1, len(parts)):  # the largest pure prefix holding more than this one tensor
            prefix = ".".join(parts[:k])
            if pure.get(prefix) and count[prefix] > 1:
                label = f"{prefix}.* ({count[prefix]} tensors)"
                break
        if label not in seen:
            seen.add(label)
            labels.append(label)
    shown = ", ".join(labels[:_NAMES_SHOWN])
    return shown + (f" and {len(labels) - _NAMES_SHOWN} more" if len(labels) > _NAMES_SHOWN else "")


class _Watched:
    __slots__ = ("name", "param", "opt", "group", "idx", "prev", "pending")

    def __init__(self, name, param, opt, group, idx):
        self.name, self.param, self.opt, self.group, self.idx = name, weakref.ref(param), weakref.ref(opt), group, idx
        self.prev = None  # the sampled elements at the last measured step
        self.pending = None


def _spread(items: list, n: int) -> list:
    if len(items) <= n:
        return items
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


class Updates:
    def __init__(self, torch):
        self.torch = torch
        self._trainable: list = []
        self._frozen: list = []
        self._every: list = []
        self._pending = None  # (host flags, event, step) of a device verdict not read yet
        self._opt = None  # weakref to the lead optimizer
        self._sched = None  # weakref to the lead optimizer's scheduler
        self._sched_base = None  # (step, last_epoch) when it was first seen
        self._look_at = 0  # the step of the next look for a scheduler while none is known

    # -- targets -------------------------------------------------------------------------------------------------
    def refresh(self, model, optimizer) -> None:
        """Pick the tensors to watch in ``model`` (those an optimizer found holds) and the scheduler of
        ``optimizer``."""
        torch = self.torch
        held: dict = {}
        for f in finder.optimizers():
            inner, _ = finder.unwrap_optimizer(f.obj)
            for gi, group in enumerate(inner.param_groups):
                for p in group["params"]:
                    held[id(p)] = (inner, gi)
        named = [(finder.module_path(n), p) for n, p in model.named_parameters()]
        self._every = [n for n, _ in named]
        old = {w.name: w for w in self._trainable + self._frozen}
        trainable, frozen = [], []
        for name, p in named:
            if id(p) not in held or not p.is_floating_point() or p.numel() == 0 or type(p.data) is not torch.Tensor:
                continue  # a DTensor or another subclass: reading it could be a collective
            (trainable if p.requires_grad else frozen).append((name, p))
        out = []
        for kind in (_spread(trainable, _SAMPLE), _spread(frozen, _SAMPLE)):
            watched = []
            for name, p in kind:
                w = old.get(name)
                if w is not None and w.param() is p:
                    watched.append(w)
                    continue
                n = p.numel()
                idx = torch.linspace(0, n - 1, min(_ELEMENTS, n), device=p.device).long()
                opt, gi = held[id(p)]
                watched.append(_Watched(name, p, opt, gi, idx))
            out.append(watched)
        self._trainable, self._frozen = out
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

    # -- the checks ------------------------------------------------------------------------------------------------
    def check(self, step: int, now: float, record) -> None:
        try:
            self._motion(step, now, record)
        except Exception as exc:
            record_error("torch checks: parameters move", exc)
        try:
            self._schedule(step, now, record)
        except Exception as exc:
            record_error("torch checks: scheduler pace", exc)

    def _lr(self, w) -> float | None:
        opt = w.opt()
        if opt is None:
            return None
        lr = opt.param_groups[w.group].get("lr")
        if isinstance(lr, self.torch.Tensor):
            return float(lr) if not lr.is_cuda else None
        return float(lr) if lr is not None else None

    def _motion(self, step, now, record) -> None:
        torch = self.torch
        if self._pending is not None:  # a device verdict from the last measured step
            host, ev, items, at = self._pending
            if not ev.query():
                return
            self._pending = None
            self._verdict(at, now, record, items, host.tolist())
        flags, items = [], []
        for w in self._trainable + self._frozen:
            p = w.param()
            if p is None:
                continue
            v = p.detach().reshape(-1).index_select(0, w.idx)
            frozen = not p.requires_grad
            if frozen:
                if w.prev is not None:
                    flags.append(torch.stack([(v != w.prev).any(), torch.ones((), dtype=torch.bool, device=v.device)]))
                    items.append((w, True))
                w.prev = v
                continue
            g = p.grad
            lr = self._lr(w)
            if g is None or g.is_sparse or type(g) is not torch.Tensor or not lr:
                w.prev = v
                continue
            # elements whose update lr * grad is well above the float's resolution at their value (a conv bias under
            # batch norm has a gradient of ~1e-9: its SGD update rounds away, and that is no bug)
            nz = g.detach().reshape(-1).index_select(0, w.idx).abs() * lr > v.abs() * _RESOLUTION
            if w.prev is not None:
                flags.append(torch.stack([((v != w.prev) & nz).any(), nz.any()]))
                items.append((w, False))
            w.prev = v
        if not items:
            return
        dev = next((f.device for f in flags if f.is_cuda), None)
        stacked = torch.stack([f.to(dev) for f in flags]) if dev is not None else torch.stack(flags)
        if stacked.is_cuda:
            host = torch.empty(stacked.shape, dtype=torch.bool, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._pending = (host, ev, items, step)
            return
        self._verdict(step, now, record, items, stacked.tolist())

    def _verdict(self, step, now, record, items, flags) -> None:
        still, moved, watched_t, watched_f = [], [], 0, 0
        for (w, frozen), (changed, graded) in zip(items, flags):
            if frozen:
                watched_f += 1
                if changed:
                    moved.append(w.name)
            elif graded:
                watched_t += 1
                if not changed:
                    still.append(w.name)
        if watched_t:
            record(
                step,
                now,
                "params_move",
                not still,
                grouped(still, self._every) if still else None,
                float(len(still)),
                f"{len(still)} of {watched_t} sampled tensors with a non-zero gradient and learning rate did not "
                "change at the step"
                if still
                else None,
            )
        if watched_f:
            record(
                step,
                now,
                "frozen_still",
                not moved,
                grouped(moved, self._every) if moved else None,
                float(len(moved)),
                f"{len(moved)} of {watched_f} sampled tensors with requires_grad=False that an optimizer holds changed "
                "since the last measured step"
                if moved
                else None,
            )

    def _schedule(self, step, now, record) -> None:
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
        problem = None
        if stepped > steps + 1 and steps >= 10:
            problem = (
                f"{kind} stepped {stepped} times in {steps} optimizer steps: more often than its optimizer "
                "(stepped per batch and again per epoch, or twice a step?)"
            )
        elif steps >= _PACE_STEPS and stepped * 4 < steps and self._per_step(sched):
            problem = (
                f"{kind} counts optimizer steps ({self._horizon(sched)}) but stepped {stepped} times in {steps} "
                "optimizer steps: it is stepped once an epoch, so its schedule hardly moves (warm-up never ends)"
            )
        elif kind == "CosineAnnealingLR" and last > getattr(sched, "T_max", last) and stepped * 2 > steps:
            problem = (
                f"CosineAnnealingLR is at step {last}, past its T_max={sched.T_max}, where its rate climbs back up "
                f"(stepped {stepped} times in {steps} optimizer steps: stepped per batch while T_max counts epochs?)"
            )
        record(step, now, "schedule", problem is None, kind, float(stepped) / steps if steps else None, problem)

    @staticmethod
    def _per_step(sched) -> bool:
        if type(sched).__name__ in _PER_STEP:
            return True
        fns = getattr(sched, "lr_lambdas", None) or []
        for fn in fns:  # transformers' get_*_schedule_with_warmup: a partial of a *_with_warmup_lr_lambda
            name = getattr(getattr(fn, "func", fn), "__name__", "")
            if "warmup" in name:
                return True
        return False

    @staticmethod
    def _horizon(sched) -> str:
        total = getattr(sched, "total_steps", None)
        return f"total_steps={total}" if total is not None else "its schedule is in optimizer steps"
