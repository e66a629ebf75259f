"""A param group's rate and what drives it, for the lr action (``lr``).

Reading and writing a rate (a float, or a tensor that capturable optimizers keep and that is
changed in place); the torch LR scheduler that computes a group's rate from base rates, whose
bases are scaled (``rescale``) instead of the rate being held; the largest rate a step of a
group can take without overflowing its parameters' dtype; and two rates printed apart.
"""

from __future__ import annotations

import weakref

__all__ = ["value", "write", "apart", "Rescaled", "SCHED_KEYS", "schedulers_in", "rescalable", "rescale", "dtype_limit"]

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


def rescale(sched, group: dict, i: int, factor: float) -> None:
    """Scale what ``sched`` computes group ``i``'s rate from, and the rate in effect now."""
    group["lr"] = group["lr"] * factor
    for key in SCHED_KEYS:
        if isinstance(group.get(key), float):
            group[key] = group[key] * factor
    for s in schedulers_in(sched):
        for attr in ("base_lrs", "max_lrs", "_last_lr"):
            values = getattr(s, attr, None)
            if isinstance(values, list) and len(values) > i and isinstance(values[i], (float, int)):
                values[i] = values[i] * factor


def dtype_limit(group: dict) -> tuple[float, str] | None:
    """The largest rate a step of ``group`` can use without overflowing its parameters' dtype, and that dtype.

    An optimizer multiplies the rate into a value of the parameters' dtype (``-lr`` for SGD,
    ``lr / (1 - beta1**t)`` for Adam), and torch raises when that value does not fit: the
    training loop then dies at ``optimizer.step()``.
    """
    import torch

    dtypes = {p.dtype for p in group.get("params", ()) if getattr(p, "is_floating_point", lambda: False)()}
    if not dtypes:
        return None
    dtype = min(dtypes, key=lambda d: torch.finfo(d).max)
    betas = group.get("betas")
    factor = 1.0
    if isinstance(betas, (tuple, list)) and betas and 0 <= float(betas[0]) < 1:
        factor = 1.0 - float(betas[0])  # Adam's first step divides the rate by 1 - beta1
    return torch.finfo(dtype).max * factor * _HEADROOM, str(dtype).replace("torch.", "")
