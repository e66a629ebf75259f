"""The lr overrides each optimizer holds, and the rates they work on (for the lr action, ``lr``).

An override is applied around each step of its optimizer through the step boundary's ``before_step``
registration (``_around_step``, registered while an override exists): before the step, the group's rate becomes
the loop's rate times the scale (or the value set); right after it, the loop's own rate goes back, and the step
tracker is told which rate the step used. ``describe`` shows them in torch.optimizer.

A group driven by a torch LR scheduler computed from base rates is scaled there instead (``rescalable``,
``rescale``, ``Rescaled``): the scheduler then makes the new rate itself. A change is checked at the optimizer's
next step, never assumed: ``check_once`` (``--once``: was the value written still there when the step started?),
``check_rescaled`` (is the rate the step used the scheduler's?) and ``settle`` (which rate the step used, and
whether the loop rewrote its own rate meanwhile, so that the override was re-applied). Rates are read and written
as floats or as the tensors capturable optimizers keep (changed in place); ratios never divide by a denormal or 0.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref

from .._errors import ActionError
from .._core.boundary import boundary
from ..training.finder import scheduler_for
from ..util.errorlog import record_error

lock = threading.Lock()  # guards overrides: the action adds and removes, the step post-hook removes a finished one
overrides: dict[int, "Override"] = {}  # id(optimizer) -> its override (``hold``, ``drop``)


def hold(opt, ov: "Override") -> None:
    """Keep ``ov`` for ``opt`` (under ``lock``): its steps go through ``_around_step`` from now on."""
    overrides[id(opt)] = ov
    boundary.before_step(_around_step)


def drop(key: int) -> None:
    """Forget the override of the optimizer whose id is ``key`` (under ``lock``); the last one takes the
    boundary registration with it, so steps pay nothing for the lr action once no override is left."""
    overrides.pop(key, None)
    if not overrides:
        boundary.remove(_around_step)


class Group:
    """The override held on one param group: its mode and value, the rates around the last step, what it did."""

    __slots__ = (
        "mode",
        "value",
        "loop",
        "used",
        "since",
        "held",
        "rewrites",
        "last_rewrite",
        "written",
        "rows",
        "limit",
    )

    def __init__(self, mode: str, value: float, loop: float, since: int | None):
        self.mode, self.value = mode, value  # "scale" or "set"
        self.loop = loop  # the loop's rate seen at the last step
        self.used = None  # the rate the last step used
        self.written = None  # what the pre-hook wrote (restored only if still there)
        self.since = since
        self.held = 0
        self.rewrites = 0
        self.last_rewrite = None
        self.rows: list = []  # the result rows (probe.actions) of the action that set the override: kept current
        self.limit = math.inf  # the most its parameters' dtype can take in a step (a scale follows the loop's rate)

    def status(self) -> str:
        text = f"held for {self.held} step(s)"
        if self.rewrites:
            text += (
                f"; re-applied because the loop rewrote lr at step {self.last_rewrite} ({self.rewrites} time(s) so far)"
            )
        return text

    def hand_over(self, why: str) -> None:
        """The override changes hands (a later action, --reset): its old action's rows say so and stop following."""
        for row in self.rows:
            row["status"] = f"{self.status()}; {why}"
        self.rows = []

    def target(self, loop: float) -> float:
        return loop * self.value if self.mode == "scale" else self.value

    def text(self) -> str:
        return f"scale {self.value:g}" if self.mode == "scale" else f"set {self.value:g}"


class Override:
    """The state of each overridden group of one optimizer, applied by probe's global step hooks."""

    def __init__(self, opt, name: str):
        self.ref = weakref.ref(opt)
        self.name = name
        self.groups: dict[int, Group] = {}
        self.rescaled: dict[int, Rescaled] = {}  # groups whose scheduler's base rates were scaled instead
        self.pending: list = []  # (settle, result, once, rows) waiting for the next step

    # -- around every step of this optimizer (training thread) ------------------------------------
    def before(self, opt) -> None:
        step = _step() + 1
        pgs = opt.param_groups
        for i, g in list(self.groups.items()):
            if i >= len(pgs):
                continue
            loop = value(pgs[i]["lr"])
            if g.held and loop != g.loop:
                g.rewrites += 1
                g.last_rewrite = step
            g.loop = loop
            target = g.target(loop)
            if not target <= g.limit:  # the loop's own rate grew under a scale: keep the step alive, say why
                record_error(
                    "lr override",
                    ActionError(
                        f"{g.text()} of group {i} would give {target:g}, past what "
                        f"its parameters can take ({g.limit:.3g}); this step uses the loop's rate"
                    ),
                )
                target = loop
            g.used = g.written = target  # before the write: describe() reads g.loop/g.used from here on
            write(pgs[i], g.used)
        for item in list(self.pending):
            check_once(item, pgs, step)
            check_rescaled(self.rescaled, item, pgs, step)

    def after(self, opt) -> float | None:
        step = _step() + 1
        pgs = opt.param_groups
        for i, g in list(self.groups.items()):
            if i >= len(pgs) or g.written is None:
                continue
            g.held += 1
            if g.rows:
                status = g.status()
                for row in g.rows:
                    row["status"] = status
            if value(pgs[i]["lr"]) == g.written:  # nobody changed it during the step: put the loop's back
                write(pgs[i], g.loop)
            g.written = None
        pending, self.pending = self.pending, []
        for item in pending:
            settle(self.groups, item, step)
        if not self.groups and not self.rescaled and not self.pending:
            with lock:
                if overrides.get(id(opt)) is self:
                    drop(id(opt))
        g0 = self.groups.get(0)
        return g0.used if g0 is not None else None  # the rate group 0 used: torch.steps.lr


def _around_step(opt):
    """Before ``opt``'s step (the boundary's ``before_step``): apply its override; returns what puts the loop's
    rates back right after the step (before the step's row reads them)."""
    ov = overrides.get(id(opt))
    if ov is None or ov.ref() is not opt:
        return None
    try:
        ov.before(opt)
    except Exception as exc:
        record_error("lr override: before the optimizer step", exc)
    return ov.after


def _step() -> int:
    return boundary.last_step or 0


def describe(opt) -> dict:
    """The override of ``opt``'s groups for torch.optimizer: ``{group: {override, lr, loop_lr, status}}``, the two
    rates read at one moment (never the held rate taken for the loop's between the hold and the loop's rewrite)."""
    ov = overrides.get(id(opt))
    if ov is None or ov.ref() is not opt:
        return {}
    out = {}
    for i, r in list(ov.rescaled.items()):
        try:
            lr = value(opt.param_groups[i]["lr"])
        except Exception:
            continue
        out[i] = {
            "override": r.text(),
            "lr": lr,
            "loop_lr": lr,
            "status": f"the scheduler's base rate scaled at step {r.since}: param_groups shows the rate in effect",
        }
    for i, g in list(ov.groups.items()):
        if g.written is not None:  # inside a step (the server thread reads while the training thread steps):
            loop, lr = g.loop, g.used  # param_groups may hold the override or the loop's rate; these are one moment's
        else:
            try:
                loop = value(opt.param_groups[i]["lr"])
            except Exception:
                continue
            lr = g.target(loop)
        out[i] = {"override": g.text(), "lr": lr, "loop_lr": loop, "status": g.status()}
    return out


def next_rates(opt, groups: list) -> list:
    """The rate each of ``groups`` (``opt``'s param groups) uses at its next step: the loop's, or the
    override's on top of it."""
    with lock:
        ov = overrides.get(id(opt))
    if ov is not None and ov.ref() is not opt:
        ov = None  # a dead optimizer's id reused
    rates = []
    for i, group in enumerate(groups):
        loop = value(group["lr"])
        g = ov.groups.get(i) if ov is not None else None
        rates.append(g.target(loop) if g is not None else loop)
    return rates


# -- checking that a change took effect -----------------------------------------------------------
def check_once(item, pgs, step) -> None:
    """--once: the value written at the action must still be there when the step starts."""
    _, result, once, rows = item
    if not once:
        return
    for g in rows:
        i = g["group"]
        now = value(pgs[i]["lr"])
        g["used"] = now
        g["status"] = f"used by step {step}" if now == g["after"] else f"rewritten by the loop before step {step}"
        if now != g["after"]:
            result["error"] = (
                f"the loop rewrote group {i}'s lr to {now:.6g} before step {step} used {g['after']:.6g} "
                "(its scheduler or its own code sets the rate each step); run `lr` without --once "
                "to hold the change."
            )


def check_rescaled(rescaled: dict, item, pgs, step: int) -> None:
    """A scheduler-scaled group, before the next step: is the rate in param_groups the scheduler's?"""
    _, result, once, rows = item
    for g in rows:
        r = rescaled.get(g["group"])
        if once or g.get("via") != "scheduler" or r is None or "used" in g:
            continue
        sched = r.sched()
        now = value(pgs[g["group"]]["lr"])
        g["used"] = now
        last = getattr(sched, "_last_lr", None) if sched is not None else None
        made = last[g["group"]] if isinstance(last, list) and len(last) > g["group"] else None
        if made is not None and abs(now - made) <= 1e-12 * max(abs(made), 1e-300):
            g["status"] = (
                f"the scheduler computes from the scaled base rate: step {step} used its rate; "
                "param_groups, get_last_lr() and the loop's own logs show the rate in effect"
            )
        else:
            g["status"] = (
                f"step {step} used {now:.6g} but the scheduler made {made if made is None else f'{made:.6g}'}: "
                "something rewrote the rate after the scheduler; use `lr --reset` then `lr` again after "
                "stopping that code, or --once"
            )
            result["error"] = f"group {g['group']}'s rate was rewritten after its scheduler before step {step} ran"


def settle(groups: dict, item, step: int) -> None:
    """Settle the action of ``item`` at ``step``: its result says which rate the step used, and whether the
    loop had rewritten its own rate by then (the override was re-applied)."""
    settle, result, once, rows = item
    result["checked_at_step"] = step
    if not once:
        for g in rows:
            og = groups.get(g["group"])
            if og is None:
                continue
            g["used"] = og.used
            g["loop_lr"] = og.loop
            if og.loop != g["loop_before"]:
                before, after = apart(g["loop_before"], og.loop)
                g["note"] = (
                    f"re-applied: the loop rewrote its lr from {before} to {after} at step {step}; the "
                    "loop's own logs show its value, torch.steps.lr what each step used"
                )
    settle(result.get("error"))


# -- rates ----------------------------------------------------------------------------------------
def value(lr) -> float:
    return float(lr)  # a tensor lr (capturable optimizers) is read here; it lives on the CPU in practice


def write(group: dict, value: float) -> None:
    current = group["lr"]
    if hasattr(current, "fill_"):  # a tensor lr: change it in place, the optimizer holds that tensor
        current.fill_(value)
    else:
        group["lr"] = value


def apart(a: float, b: float) -> tuple[str, str]:
    """Two different rates printed with as many digits as it takes to tell them apart.

    >>> apart(0.05, 0.0499999871)
    ('0.05', '0.04999999')
    >>> apart(0.1, 0.2)
    ('0.1', '0.2')
    """
    for digits in range(6, 18):
        x, y = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if x != y:
            return x, y
    return f"{a!r}", f"{b!r}"


def ratio(a: float, b: float) -> float | None:
    """``a / b`` where that is a usable number: ``b`` a normal float (never 0, a denormal, NaN or infinite) and the
    quotient finite and either 0 or normal; else None.

    >>> ratio(0.05, 0.5)
    0.1
    >>> ratio(0.05, 5e-324) is None, ratio(0.05, 0.0) is None, ratio(1e300, 1e-300) is None
    (True, True, True)
    >>> ratio(0.0, 0.5), ratio(1e-300, 1e10) is None, ratio(1e-300, 1e100) is None
    (0.0, True, True)
    """
    if not (math.isfinite(b) and abs(b) >= sys.float_info.min) or not math.isfinite(a):
        return None
    q = a / b
    return q if _usable(q, a) else None


def invertible(x: float | None) -> bool:
    """A positive normal float whose inverse is one too: a factor that can be divided out again.

    >>> invertible(0.5), invertible(1e-320), invertible(0.0), invertible(float("nan")), invertible(1e308)
    (True, False, False, False, False)
    """
    return x is not None and x > 0 and ratio(x, 1.0) is not None and ratio(1.0, x) is not None


def _usable(x: float, source: float) -> bool:
    """``x``, computed from ``source``, is finite, and a normal float or a 0 that ``source`` was too (a denormal has
    lost its precision and its inverse is infinite; a 0 from a nonzero number is an underflow)."""
    return math.isfinite(x) and (abs(x) >= sys.float_info.min or x == 0 == source)


class Rescaled:
    """A group whose scheduler computes from scaled base rates (no hold: the scheduler makes the rate)."""

    __slots__ = ("sched", "factor", "since", "label")

    def __init__(self, sched, factor: float, since: int | None, label: str):
        self.sched, self.factor, self.since, self.label = weakref.ref(sched), factor, since, label

    def text(self) -> str:
        return f"{self.label} (scheduler base)"


SCHED_KEYS = ("initial_lr", "max_lr", "min_lr")  # the group's own copies of rates some schedulers compute from


def schedulers_in(sched) -> list:
    """``sched`` and the schedulers it chains (SequentialLR, ChainedScheduler)."""
    out = [sched]
    for child in getattr(sched, "_schedulers", None) or ():
        out += schedulers_in(child)
    return out


def rescalable(opt, i: int):
    """The torch LR scheduler that drives group ``i`` of ``opt`` from base rates, else None (the hold applies)."""
    if type(opt.param_groups[i]["lr"]) is not float:
        return None
    for f in scheduler_for(opt):
        sched = f.obj
        inner = getattr(sched, "scheduler", None)
        if inner is not None and not hasattr(sched, "base_lrs") and hasattr(inner, "optimizer"):
            sched = inner  # accelerate's AcceleratedScheduler: the scheduler it drives
        for one in schedulers_in(sched) if sched is not None else ():  # SequentialLR: its chained ones'
            base = getattr(one, "base_lrs", None)
            if isinstance(base, list) and len(base) > i and isinstance(base[i], float):
                return sched
        if isinstance(getattr(sched, "min_lrs", None), list):  # ReduceLROnPlateau: multiplies the group's own rate
            return sched
    return None


def rescale(sched, group: dict, i: int, factor: float, *, limit: float = math.inf, undo: bool = False) -> bool:
    """Scale what ``sched`` computes group ``i``'s rate from, and the rate in effect now, by ``factor``
    (``undo``: divide it back out).

    A factor whose inverse is not a usable number (0, a denormal) could never be divided out again, and
    a chainable scheduler (StepLR, ExponentialLR, ReduceLROnPlateau) multiplies the group's current rate
    for ever after, so a 0, a NaN or an infinity written there stays. So nothing is changed, and False
    returned, when ``factor`` or its inverse is not a normal float or any scaled value would not be finite,
    would pass ``limit``, or would be a denormal. Undoing never writes a value that is not finite (it
    keeps that one as it is).
    """
    if not undo and not invertible(factor):
        return False

    def scaled(v: float) -> float | None:
        if undo:
            return ratio(v, factor)
        return v * factor if _usable(v * factor, v) else None

    changes = []  # (container, key, new value)
    for key in ("lr",) + SCHED_KEYS:
        if isinstance(group.get(key), float):
            changes.append((group, key, scaled(group[key])))
    for s in schedulers_in(sched):
        for attr in ("base_lrs", "max_lrs", "_last_lr"):
            values = getattr(s, attr, None)
            if isinstance(values, list) and len(values) > i and isinstance(values[i], (float, int)):
                changes.append((values, i, scaled(values[i])))
    if not undo and any(new is None or new > limit for _, _, new in changes):
        return False
    for where, key, new in changes:
        if new is not None:
            where[key] = new
    return True
