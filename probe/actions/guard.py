"""The guard: a safety net armed on a live job (``probe PID guard``, ``PROBE_GUARD``; docs/guard.md).

Armed at a step boundary, it wraps ``step`` of every optimizer found and of the schedulers that drive them
(instance attributes) and, with ``--keep N``, puts a forward pre-hook on the model that keeps the last N steps'
inputs; ``--rollback`` copies the weights and optimizer state to the host before each applied step. Disarmed, none
of these exist: the step path costs nothing. Before each update the wrapper reads the gradient norm (one number
from the device, as GradScaler's skip check does) and the step's loss, checks the triggers, writes the evidence
(``evidence``), and skips the update or restores the kept copy.

On several ranks every decision must be the same everywhere, or the replicas drift apart: it is taken from the
gradients after backward (DDP all-reduced them) and from the weights, never from the rank's own loss and never by a
collective of probe's; so a loss trigger with ``--skip``/``--rollback`` is refused there, and so are
``--skip``/``--rollback`` under sharded gradients (FSDP2), which have no common view.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import types
from collections import deque
from dataclasses import dataclass

from ..config import setting
from .._errors import ActionError
from ..training import finder, hooks
from .._core.boundary import boundary
from ..training.hooks import InputCounter
from ..training.frameworks import is_sharded
from ..util.errorlog import record_error
from .evidence import (
    bundle,
    copy_state,
    finite,
    first_nonfinite,
    grad_norm,
    host_copy,
    keep_cost,
    median,
    restore_state,
    step_loss,
    write_evidence,
)


WINDOW = 50  # applied steps whose median a spike is measured against (the doctor's gradient-norm spike score)
MIN_HISTORY = 10  # steps seen before a spike can trigger
BATCH_BYTES = 256 * 2**20  # the kept batches, all together, at most


@dataclass
class Spec:
    """What to guard against (``nonfinite``; ``spike``, ``loss``: a ratio or None) and what to do."""

    nonfinite: bool = False
    spike: float | None = None
    loss: float | None = None
    keep: int = 1
    skip: bool = False
    rollback: bool = False
    evidence: str | None = None

    def describe(self) -> str:
        on = ["nonfinite"] * self.nonfinite + [f"{k}={v:g}" for k in ("spike", "loss") if (v := getattr(self, k))]
        flags = ["--skip"] * self.skip + ["--rollback"] * self.rollback
        where = [f"--evidence {self.evidence}"] if self.evidence else []
        return " ".join([f"--on {','.join(on)}", f"--keep {self.keep}", *flags, *where])


def parse_spec(on: str | None = None, keep=1, skip=False, rollback=False, evidence=None) -> Spec:
    """A Spec from the action's fields. ``on`` is a comma-separated list of triggers (``nonfinite``, ``spike=N``,
    ``loss=N``; ``nonfinite`` when empty) and, as PROBE_GUARD writes it, of ``keep=N``, ``skip``, ``rollback`` and
    ``evidence=DIR``."""
    spec = Spec(keep=keep, skip=bool(skip), rollback=bool(rollback), evidence=evidence or None)
    for item in (on or "nonfinite").split(","):
        name, eq, value = item.strip().partition("=")
        if name in ("nonfinite", "skip", "rollback") and not eq:
            setattr(spec, name, True)
        elif name in ("spike", "loss") and value:
            ratio = float(value) if value.replace(".", "", 1).isdigit() else math.nan
            if not ratio > 1:
                raise ActionError(f"{name}={value}: give a ratio above 1, e.g. {name}=50.")
            setattr(spec, name, ratio)
        elif name == "keep" and value.isdigit():
            spec.keep = int(value)
        elif name == "evidence" and value:
            spec.evidence = value
        else:
            raise ActionError(f"unknown trigger {item.strip()!r}; give nonfinite, spike=N or loss=N, comma-separated.")
    if not (spec.nonfinite or spec.spike or spec.loss):
        spec.nonfinite = True
    if isinstance(spec.keep, bool) or not isinstance(spec.keep, int) or not 0 <= spec.keep <= 64:
        raise ActionError("--keep takes a whole number of steps from 0 to 64.")
    if spec.evidence is not None and (not isinstance(spec.evidence, str) or "\0" in spec.evidence):
        raise ActionError("--evidence takes a directory path.")
    return spec


def arm_from_setting() -> None:
    """PROBE_GUARD (``nonfinite,spike=50,keep=1,skip,evidence=DIR``): armed at the first step boundary."""
    text = setting("PROBE_GUARD")
    if not text:
        return
    try:
        spec = parse_spec(str(text))
    except ActionError as exc:
        print(f"probe: PROBE_GUARD: {exc.message} The guard is not armed.", file=sys.stderr, flush=True)
        return

    def first(event) -> None:
        boundary.remove(first)
        try:
            arm(spec, event.step)
        except ActionError as exc:
            print(f"probe: PROBE_GUARD: {exc.message}", file=sys.stderr, flush=True)

    _from_setting[:] = [first]
    boundary.after_step(first)


def stand_down() -> None:
    """What the probe's stop undoes: a PROBE_GUARD not yet armed, and an armed guard's wrappers and hook."""
    for first in _from_setting:
        boundary.remove(first)
    _from_setting.clear()
    if current() is not None:
        disarm(boundary.last_step)


# -- what is armed, and what it caught ------------------------------------------------------------------------
_lock = threading.RLock()
_guard: list = []  # the armed Guard, if any
_from_setting: list = []  # PROBE_GUARD's first-boundary callback, until it ran
_events: deque = deque(maxlen=1000)  # torch.guard's rows


def current():
    return _guard[0] if _guard else None


def events() -> list[dict]:
    return list(_events)


def _event(kind: str, step, spec: Spec, **fields) -> dict:
    row = {"event": kind, "step": step, "time": time.time(), "armed": spec.describe(), **fields}
    with _lock:
        _events.append(row)
    return row


def _targets():
    """The optimizers to guard, the primary model and its name: refused with a sentence when there is none."""
    opts = finder.optimizers_to_act_on()
    tk = hooks.tracker()
    model = InputCounter.primary_model(tk.lead_optimizer() if tk is not None else opts[0].obj)
    name = next((f.name for f in finder.models() if f.obj is model), None)
    return opts, model, name


def estimate(spec: Spec, targets=None) -> dict:
    """The host memory the guard will hold; refused when it would not fit (``evidence.keep_cost``), or when a
    skip or a rollback could differ between ranks (``_check_ranks``)."""
    import torch

    opts, model, _ = targets or _targets()
    _check_ranks(spec, [p for f in opts for g in f.obj.param_groups for p in g["params"]])
    return keep_cost(torch, [f.obj for f in opts], model, spec.keep, spec.rollback, BATCH_BYTES)


def _check_ranks(spec: Spec, params) -> None:
    acts = spec.skip or spec.rollback
    if acts and any(is_sharded(p) for p in params):
        raise ActionError(
            "the parameters are sharded (FSDP2/DTensor): no rank sees the whole gradient, so a skip or a rollback "
            "decided here could differ between ranks; arm the guard without --skip and --rollback."
        )
    if acts and _several() and spec.loss is not None:
        raise ActionError(
            "loss=N reads this rank's own loss, which differs between ranks, so a skip or a rollback decided on it "
            "would set the replicas apart; use spike=N (the gradients are the same on every rank) or drop --skip "
            "and --rollback."
        )


def arm(spec: Spec, step) -> dict:
    """Arm (or re-arm) the guard on the training thread, at a step boundary; return what was armed."""
    import torch

    targets = _targets()
    cost = estimate(spec, targets)
    opts, model, name = targets
    with _lock:
        old = current()
        if old is not None:
            old.close()
            _guard.clear()
        g = Guard(torch, spec, [f.obj for f in opts], model, name)
        _guard.append(g)
    _event("armed", step, spec, optimizers=[f.name for f in opts], model=name, **cost)
    return {"armed": spec.describe(), "optimizers": [f.name for f in opts], "model": name, "step": step, **cost}


def disarm(step) -> dict:
    """Take every wrapper and hook out; say what the guard caught while armed."""
    with _lock:
        g = current()
        if g is None:
            return {"armed": None, "caught": 0, "step": step}
        g.close()
        _guard.clear()
    _event("disarmed", step, g.spec, caught=g.caught)
    return {"armed": None, "was": g.spec.describe(), "caught": g.caught, "step": step, "hooks_left": g.hooked()}


def state() -> dict:
    """What ``probe guard`` shows: what is armed, how many steps it checked, its last 20 catches of ``events``."""
    g = current()
    caught = [e for e in events() if e["event"] == "trigger"]
    armed = {"armed": g.spec.describe(), "spec": vars(g.spec), "checked": g.checked} if g is not None else {}
    return {"armed": None, "spec": None, "checked": 0, **armed, "caught": caught[-20:], "events": len(caught)}


_MISSING = object()


def _several() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


class Guard:
    """The armed guard: the wrappers and the hook it installed (``close()`` takes every one out), the recent
    norms and losses, the kept batches and the state copied before the last applied step of each optimizer."""

    def __init__(self, torch, spec: Spec, optimizers, model, model_name):
        self.torch, self.spec = torch, spec
        self.model, self.model_name = model, model_name
        self.norms: deque = deque(maxlen=WINDOW)
        self.losses: deque = deque(maxlen=WINDOW)
        self.batches: deque = deque()  # {"step", "calls", "bytes"}, oldest first
        self.calls: list = []  # the step in progress's forward inputs
        self.call_bytes = 0
        self.snapshots: dict = {}  # id(optimizer) -> (step, copy_state()) before its last applied step (--rollback)
        self.caught = 0
        self.checked = 0  # optimizer steps seen
        self.skipped: set = set()  # ids of optimizers whose step was skipped: their scheduler's next step is too
        self.wrapped: list = []
        self.closed = False
        self.handle = None
        try:
            for opt in optimizers:
                self._wrap(opt, self._guarded(opt))
                for f in finder.scheduler_for(opt):
                    self._wrap(f.obj, self._scheduler(opt))
            if spec.keep and model is not None:
                self.handle = model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        except BaseException:
            self.close()
            raise

    # -- installing and removing ------------------------------------------------------------------------------
    def _wrap(self, obj, fn) -> None:
        """Put ``fn(original, *args, **kwargs)`` in front of ``obj.step`` as an instance attribute (a bound
        method: an LR scheduler made later wraps it as it would the class's)."""
        prev = obj.__dict__.get("step", _MISSING)
        orig = obj.step

        def step(_self, *args, **kwargs):
            if self.closed:  # something wrapped it again after us: it stays in place and passes through
                return orig(*args, **kwargs)
            return fn(orig, *args, **kwargs)

        if getattr(orig, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True
        bound = types.MethodType(step, obj)
        obj.step = bound
        self.wrapped.append((obj, prev, bound))

    def close(self) -> None:
        self.closed = True
        for obj, prev, bound in reversed(self.wrapped):
            if obj.__dict__.get("step") is bound:
                if prev is _MISSING:
                    del obj.step
                else:
                    obj.step = prev
        self.wrapped = []
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.remove()
        self.batches.clear()
        self.snapshots.clear()

    def hooked(self) -> int:
        """How many of its wrappers and its hook are in place (a wrapper something else wrapped again after it is
        not counted: it stays in that chain, passing through once closed)."""
        return sum(1 for obj, _, bound in self.wrapped if obj.__dict__.get("step") is bound) + (self.handle is not None)

    # -- the step ------------------------------------------------------------------------------------------------
    def _pre_hook(self, module, args, kwargs):
        """The model's training forward calls: their inputs, copied to the host, for the step's evidence."""
        if self.closed or not self.torch.is_grad_enabled():
            return None
        try:
            copy, size = host_copy(self.torch, (args, kwargs))
            if self.call_bytes + size <= BATCH_BYTES:
                self.calls.append(copy)
                self.call_bytes += size
        except Exception as exc:
            record_error("guard: keeping the batch", exc)
        return None

    def _scheduler(self, opt):
        def fn(orig, *args, **kwargs):
            if id(opt) in self.skipped:
                self.skipped.discard(id(opt))
                return None
            return orig(*args, **kwargs)

        return fn

    def _guarded(self, opt):
        def fn(orig, *args, **kwargs):
            closure = args[0] if args else kwargs.get("closure")
            result = None
            if closure is not None:
                if type(opt).__name__ == "LBFGS":  # evaluates its closure many times: left alone
                    return orig(*args, **kwargs)
                with self.torch.enable_grad():
                    result = closure()
                cached = lambda: result  # noqa: E731  (the step sees the closure's result, computed once)
                args, kwargs = ((cached, *args[1:]), kwargs) if args else ((), {**kwargs, "closure": cached})
            try:
                caught = self._check(opt, result)
            except Exception as exc:
                record_error("guard: checking the step", exc)
                caught = False
            if caught:
                return result
            return orig(*args, **kwargs)

        return fn

    def _check(self, opt, closure_result) -> bool:
        """Whether the step is caught and not to be taken (after writing its evidence and acting on it)."""
        spec = self.spec
        self.checked += 1
        tk = hooks.tracker()
        step = tk.step + 1 if tk is not None else None
        params = [p for g in opt.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        norm = grad_norm(self.torch, grads)
        several = _several()
        loss = None if several else step_loss(tk, closure_result)
        reasons = []
        if spec.nonfinite:
            if not math.isfinite(norm):
                reasons.append("non-finite gradients")
            elif loss is not None and not math.isfinite(loss):
                reasons.append("a non-finite loss")
        med = median(self.norms, MIN_HISTORY)
        if spec.spike is not None and med and math.isfinite(norm) and norm > spec.spike * med:
            reasons.append(f"a gradient norm of {norm:.4g}, {norm / med:.1f}x the median {med:.4g} of the steps before")
        lmed = median(self.losses, MIN_HISTORY)
        if spec.loss is not None and lmed and loss is not None and math.isfinite(loss) and loss > spec.loss * lmed:
            reasons.append(f"a loss of {loss:.4g}, {loss / lmed:.1f}x the median {lmed:.4g} of the steps before")
        self._end_step(step)
        if not reasons:
            self.norms.append(norm)
            if loss is not None and math.isfinite(loss):
                self.losses.append(loss)
            self.skipped.discard(id(opt))
            if spec.rollback:
                self._keep_state(opt, step, params)
            return False
        return self._caught(opt, tk, step, "; ".join(reasons), params, norm, med, loss)

    def _caught(self, opt, tk, step, reason, params, norm, med, loss) -> bool:
        spec = self.spec
        self.caught += 1
        first = path = None
        try:
            kept = self.batches[-1]["calls"] if self.batches and self.batches[-1]["step"] == step else None
            if kept and "non-finite" in reason and not _several():
                first = first_nonfinite(self.torch, self.model, kept)
            if spec.evidence:
                facts = dict(step=step, rank=getattr(tk, "rank", None), reason=reason, loss=loss, grad_norm=norm)
                facts.update(median=med, first_nonfinite=first, model_name=self.model_name)
                path = write_evidence(spec.evidence, bundle(self.torch, opt, self.model, self.batches, **facts))
        except Exception as exc:
            record_error("guard: the evidence", exc)
        taken = []
        bad = spec.rollback and not finite(self.torch, params)
        snap = self.snapshots.get(id(opt))
        if bad and snap is not None:
            restore_state(self.torch, opt, snap[1])
            taken.append(f"rolled back to the state before step {snap[0]}")
        elif bad:
            taken.append("no state kept to roll back to")
        act = spec.skip or (bad and snap is not None)
        if act:
            opt.zero_grad(set_to_none=True)
            self.skipped.add(id(opt))
            if tk is not None:
                tk.capture.forget()  # the step is not taken: its loss is not the next step's
            taken.insert(0, "skipped the update")
        elif not taken:
            taken.append("let the step go (arm --skip or --rollback to act)")
        _event(
            "trigger",
            step,
            spec,
            reason=reason,
            taken="; ".join(taken),
            loss=loss,
            grad_norm=norm,
            median=med,
            first_nonfinite=first,
            evidence=path,
            optimizer=type(opt).__name__,
        )
        return act

    def _end_step(self, step) -> None:
        """The step's forward inputs join the kept batches; the oldest go past ``keep`` steps."""
        if not self.spec.keep:
            return
        calls, self.calls, size, self.call_bytes = self.calls, [], self.call_bytes, 0
        if calls:
            self.batches.append({"step": step, "calls": calls, "bytes": size})
        while len(self.batches) > self.spec.keep or sum(b["bytes"] for b in self.batches) > BATCH_BYTES:
            self.batches.popleft()

    def _keep_state(self, opt, step, params) -> None:
        try:
            self.snapshots[id(opt)] = (step, copy_state(self.torch, opt, params, self.model))
        except Exception as exc:
            record_error("guard: keeping the state", exc)
