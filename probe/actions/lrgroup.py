"""A param group's rate and what drives it, for the lr action (``lr``).

Reading and writing a rate (a float, or a tensor that capturable optimizers keep and that is
changed in place); the torch LR scheduler that computes a group's rate from base rates, whose
bases are scaled (``rescale``) instead of the rate being held; the largest rate a step of a
group can take without overflowing its parameters' dtype, and the smallest it can take without being 0
there; ratios of rates that never divide by a denormal or zero; and two rates printed apart.
"""

from __future__ import annotations

import math
import sys
import weakref

__all__ = [
    "value",
    "write",
    "apart",
    "ratio",
    "invertible",
    "Rescaled",
    "SCHED_KEYS",
    "schedulers_in",
    "rescalable",
    "rescale",
    "dtype_limit",
    "dtype_floor",
]

_HEADROOM = 0.01  # of the dtype's largest value: room for weight decay, momentum and bias-correction factors


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
    from ..training.finder import scheduler_for

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


def dtype_limit(group: dict) -> tuple[float, str] | None:
    """The largest rate a step of ``group`` can use without overflowing its parameters' dtype, and that dtype.

    An optimizer multiplies the rate into a value of the parameters' dtype (``-lr`` for SGD,
    ``lr / (1 - beta1**t)`` for Adam), and torch raises when that value does not fit: the
    training loop then dies at ``optimizer.step()``.
    """
    import torch

    dtypes = _float_dtypes(group)
    if not dtypes:
        return None
    dtype = min(dtypes, key=lambda d: torch.finfo(d).max)
    betas = group.get("betas")
    factor = 1.0
    if isinstance(betas, (tuple, list)) and betas and 0 <= float(betas[0]) < 1:
        factor = 1.0 - float(betas[0])  # Adam's first step divides the rate by 1 - beta1
    return torch.finfo(dtype).max * factor * _HEADROOM, _name(dtype)


def dtype_floor(group: dict) -> tuple[float, str, str]:
    """The smallest rate a step of ``group`` can use without it being 0 or losing its precision: the smallest
    normal number (``torch.finfo(dtype).tiny``) of the dtype the update is computed in, that dtype, and the
    parameters' own dtype.

    A rate is a Python float until the optimizer multiplies it into the update, where it becomes a
    number of the parameters' dtype, or float32 for narrower ones (torch's optimizers compute float16
    and bfloat16 parameters' updates in float32): 5e-324 is 0 in float32. Without floating parameters,
    float32's.
    """
    import torch

    dtypes = _float_dtypes(group)
    own = max(dtypes, key=lambda d: torch.finfo(d).tiny) if dtypes else torch.float32
    wide = {d if torch.finfo(d).bits >= 32 else torch.float32 for d in dtypes} or {torch.float32}
    compute = max(wide, key=lambda d: torch.finfo(d).tiny)
    return torch.finfo(compute).tiny, _name(compute), _name(own)


def _float_dtypes(group: dict) -> set:
    return {p.dtype for p in group.get("params", ()) if getattr(p, "is_floating_point", lambda: False)()}


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")
