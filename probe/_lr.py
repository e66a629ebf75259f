"""Change the learning rate so that the change survives the scheduler.

Setting ``param_groups[i]["lr"]`` alone is undone by the next ``scheduler.step()``
of most schedulers, which recompute the rate from their base values. So the change
is applied as a ratio ``r = new / old`` to the group's rate and to every value the
attached scheduler computes from (``base_lrs``, ``initial_lr``, ``eta_min``,
OneCycleLR's ``max_lr``/``min_lr``, CyclicLR's ``max_lrs``...): the rest of the
schedule is the old one scaled by ``r``. ReduceLROnPlateau only ever reduces the
current rate, so setting the rate is enough. A scheduler type not listed here is
refused, because its next step might silently revert the change.
"""

from __future__ import annotations

from ._actions import Context
from ._errors import ActionError
from ._objects import optimizers, scheduler_for

__all__ = ["change_lr", "SUPPORTED"]

# Schedulers whose future rates are a function of base_lrs (and the listed extra attributes) or of
# the current group lr: scaling those by r scales the rest of the schedule by r.
_BASE_SCALED = {
    "StepLR": (), "MultiStepLR": (), "ExponentialLR": (), "LambdaLR": (), "MultiplicativeLR": (),
    "LinearLR": (), "ConstantLR": (), "PolynomialLR": (), "CosineAnnealingLR": ("eta_min",),
    "CosineAnnealingWarmRestarts": ("eta_min",),
}
SUPPORTED = tuple(sorted(list(_BASE_SCALED) + ["OneCycleLR", "CyclicLR", "ReduceLROnPlateau"]))


def _supported(sched) -> str | None:
    for cls in type(sched).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in SUPPORTED:
            return cls.__name__ if cls is type(sched) else None
    return None


def _validate(sched, kind: str, groups: list[int], new: dict[int, float]) -> None:
    """Refuse before anything is changed."""
    for attr in _BASE_SCALED.get(kind, ()):
        if len(groups) != len(sched.optimizer.param_groups) and getattr(sched, attr, 0):
            raise ActionError(f"{kind} has one {attr} for all groups; change every group (leave out --group) or use --ignore-scheduler.")
    if kind == "ReduceLROnPlateau":
        low = [i for i in groups if new[i] < sched.min_lrs[i]]
        if low:
            raise ActionError(f"the new lr of group {low[0]} is below ReduceLROnPlateau's min_lr {sched.min_lrs[low[0]]:g}, which it never goes under; choose a larger value.")


def _scale_scheduler(sched, kind: str, groups: list[int], ratios: dict[int, float], new: dict[int, float]) -> list[str]:
    """Rescale the scheduler's base values for the chosen groups; return what was changed."""
    changed = []
    pgs = sched.optimizer.param_groups
    if kind in _BASE_SCALED or kind == "CyclicLR":
        for i in groups:
            if getattr(sched, "base_lrs", None) is not None and i < len(sched.base_lrs):
                sched.base_lrs[i] = sched.base_lrs[i] * ratios[i]
                changed.append(f"base_lrs[{i}]")
            if "initial_lr" in pgs[i]:
                pgs[i]["initial_lr"] = pgs[i]["initial_lr"] * ratios[i]
        for attr in _BASE_SCALED.get(kind, ()):
            if getattr(sched, attr, 0):
                setattr(sched, attr, getattr(sched, attr) * ratios[groups[0]])
                changed.append(attr)
        if kind == "CyclicLR":
            for i in groups:
                sched.max_lrs[i] = sched.max_lrs[i] * ratios[i]
            changed.append("max_lrs")
    elif kind == "OneCycleLR":
        for i in groups:
            for key in ("initial_lr", "max_lr", "min_lr"):
                pgs[i][key] = pgs[i][key] * ratios[i]
        changed.append("param_groups[initial_lr, max_lr, min_lr]")
    last = getattr(sched, "_last_lr", None)
    if isinstance(last, list):
        for i in groups:
            if i < len(last):
                last[i] = new[i]
    return changed


def plan(optimizer, group: int | None, set_to: float | None, scale: float | None) -> tuple[list[int], dict, dict]:
    pgs = optimizer.param_groups
    if group is not None and not 0 <= group < len(pgs):
        raise ActionError(f"the optimizer has {len(pgs)} param group(s), numbered 0 to {len(pgs) - 1}; --group {group} is not one of them.")
    groups = list(range(len(pgs))) if group is None else [group]
    old = {i: float(pgs[i]["lr"]) for i in groups}
    new = {i: (float(set_to) if set_to is not None else old[i] * float(scale)) for i in groups}
    ratios = {}
    for i in groups:
        if old[i] == 0:
            if new[i] == 0:
                ratios[i] = 1.0
                continue
            raise ActionError(f"group {i}'s lr is 0 right now (its schedule is at zero), so there is no ratio to apply; wait for a step where it is not 0, or use --ignore-scheduler.")
        ratios[i] = new[i] / old[i]
    return groups, old, {"new": new, "ratios": ratios}


def change_lr(ctx: Context, *, set_to: float | None, scale: float | None, group: int | None,
              optimizer_index: int | None, ignore_scheduler: bool) -> dict:
    opts = optimizers()
    if not opts:
        raise ActionError("no optimizer found in the training process; make it a global of the training script (optimizer) so probe can find it.")
    if optimizer_index is not None:
        if not 0 <= optimizer_index < len(opts):
            raise ActionError(f"there are {len(opts)} optimizer(s) ({', '.join(f.name for f in opts)}); --optimizer {optimizer_index} is not one of them.")
        opts = [opts[optimizer_index]]
    elif len(opts) > 1 and group is not None:
        raise ActionError(f"there are {len(opts)} optimizers ({', '.join(f.name for f in opts)}); pick one with --optimizer N before --group.")
    out = []
    # Check everything first, change nothing unless every optimizer can be changed.
    plans = []
    for name, opt, _, _ in opts:
        groups, old, p = plan(opt, group, set_to, scale)
        scheds = [] if ignore_scheduler else scheduler_for(opt)
        for sname, sched, _, _ in scheds:
            kind = _supported(sched)
            if kind is None:
                raise ActionError(f"the scheduler {sname} ({type(sched).__name__}) is not one probe knows how to rescale, so its next step() could undo the change; supported: {', '.join(SUPPORTED)}; pass --ignore-scheduler to change only param_groups.")
            _validate(sched, kind, groups, p["new"])
        plans.append((name, opt, groups, old, p, scheds))
    for name, opt, groups, old, p, scheds in plans:
        touched = []
        for sname, sched, _, _ in scheds:
            touched.append({"scheduler": sname, "type": type(sched).__name__,
                            "changed": _scale_scheduler(sched, _supported(sched), groups, p["ratios"], p["new"])})
        for i in groups:
            current = opt.param_groups[i]["lr"]
            if hasattr(current, "fill_"):  # a tensor lr (capturable optimizers): change it in place
                current.fill_(p["new"][i])
            else:
                opt.param_groups[i]["lr"] = p["new"][i]
        out.append({"optimizer": name, "schedulers": touched,
                    "groups": [{"group": i, "before": old[i], "after": float(opt.param_groups[i]["lr"])} for i in groups]})
    return {"step": ctx.step, "optimizers": out}
