"""Change the learning rate so that the change holds, whatever sets the rate, or say why it did not
(docs/actions.md tells the user's side).

A loop's rate is rewritten all the time (a scheduler's ``step()``, a framework, ``group["lr"] = lr`` in the
loop), so writing ``param_groups`` once is undone. Where a torch LR scheduler drives the group, the change
goes into what it computes from (its ``base_lrs`` and kin, scaled by a factor that ``--reset`` divides out);
otherwise it is an override the optimizer's step hooks apply around each step and take back after it, so the
loop keeps computing from its own numbers. The action settles at the next step of the optimizer, checked there.
The overrides, how they apply around each step and the rates they work on are in ``lroverride``; this module is
the action: one request (``LrRequest``) checked before it is queued (``check_rate``) and applied at the boundary
(``change_lr``, ``reset_lr``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._errors import ActionError
from ..training.finder import optimizers, optimizers_to_act_on, scheduler_for
from .lroverride import Group, Override, Rescaled, drop, hold, invertible, lock, next_rates, overrides, ratio
from .lroverride import rescalable, rescale, value, write
from .queue import Context


_HEADROOM = 0.01  # of the dtype's largest value: room for weight decay, momentum and bias-correction factors


@dataclass(frozen=True)
class LrRequest:
    """One ``lr`` request as the route parsed it: ``set_to`` or ``scale`` (exactly one, unless ``reset``), which
    ``group`` and ``optimizer`` (an index in torch.optimizer's order or its name; None: all), and the flags."""

    set_to: float | None = None
    scale: float | None = None
    group: int | None = None
    optimizer: int | str | None = None
    once: bool = False
    force: bool = False
    allow_zero: bool = False
    reset: bool = False


def _pick(which: int | str | None, group: int | None) -> list:
    """The optimizers an action applies to: all found, or the one ``which`` names (its index in
    torch.optimizer's order, or its ``name`` there)."""
    opts = optimizers_to_act_on()
    names = ", ".join(f"{i} {f.name}" for i, f in enumerate(opts))
    if which is not None:
        if isinstance(which, str):
            picked = [f for f in opts if f.name == which]
            if len(picked) != 1:
                raise ActionError(
                    f"no single optimizer is named {which!r}; the optimizers are {names} "
                    "(give --optimizer a name or an index from torch.optimizer)."
                )
            opts = picked
        elif not 0 <= which < len(opts):
            raise ActionError(f"there are {len(opts)} optimizer(s) ({names}); --optimizer {which} is not one of them.")
        else:
            opts = [opts[which]]
    elif len(opts) > 1 and group is not None:
        raise ActionError(f"there are {len(opts)} optimizers ({names}); pick one with --optimizer NAME before --group.")
    for f in opts:
        n = len(f.obj.param_groups)
        if group is not None and not 0 <= group < n:
            raise ActionError(
                f"the optimizer {f.name} has {n} param group(s), numbered 0 to {n - 1}; --group {group} is not one of "
                "them."
            )
    return opts


MAX_JUMP = 10.0  # a new rate past this many times the largest rate in use needs --force


def check_rate(req: LrRequest) -> None:
    """Refuse, with one sentence, a rate no step could use or that cannot train.

    Called before the action is queued (every tier: CLI, page, MCP, TCP go through the same
    route) and again when it runs. Always refused: a rate that is not finite, one that the
    parameters' dtype cannot take in a step (float16's 65504, float32's and bfloat16's 3.4e38,
    less the optimizer's factors), and one that is not 0 but below the smallest normal number of
    the dtype the update is computed in (float32's 1.18e-38: 5e-324 passes ``> 0`` and is 0 there),
    whether it is given (``set_to``) or the product of the rate in use and ``scale``. Refused unless
    asked: 0 (``allow_zero``: the weights stop changing) and more than ``MAX_JUMP`` times the largest
    rate the optimizer uses now, its loop would use without probe's override, or its scheduler started
    from (``initial_lr``) (``force``).
    """
    set_to, scale, group = req.set_to, req.scale, req.group
    for f in _pick(req.optimizer, group):
        opt = f.obj
        pgs = list(opt.param_groups)
        rates = next_rates(opt, pgs)
        largest = _reference(opt, pgs, rates)
        for i in range(len(pgs)) if group is None else [group]:
            new = set_to if set_to is not None else rates[i] * scale
            asked = f"{new:g}" if set_to is not None else f"{rates[i]:g} x {scale:g} = {new:g}"
            where = f"group {i} of {f.name}"
            if not math.isfinite(new):
                raise ActionError(
                    f"the new learning rate of {where} ({asked}) is not a finite number; "
                    "give a smaller --scale or use --set."
                )
            limit = dtype_limit(pgs[i])
            if limit is not None and new > limit[0]:
                raise ActionError(
                    f"a learning rate of {new:g} for {where} would overflow its {limit[1]} parameters in "
                    f"{type(opt).__name__}'s update (the most a step can take is about {limit[0]:.3g}) and "
                    "end the training process at its next step; give a rate that can train."
                )
            zero = set_to <= 0 if set_to is not None else scale <= 0 or rates[i] <= 0  # asked for, not underflowed
            if zero and not req.allow_zero:
                raise ActionError(
                    f"a learning rate of 0 for {where} stops training (its weights no longer change); "
                    "give --allow-zero if that is what you want."
                )
            floor, computed, own = dtype_floor(pgs[i])
            if not zero and new < floor:
                raise ActionError(
                    f"a learning rate of {asked} for {where} is below {floor:g}, the smallest normal {computed} "
                    "number"
                    + (f" (the dtype its {own} parameters' update is computed in)" if own != computed else "")
                    + f", so the update would take it as 0 or lose its precision; give a rate of at least {floor:g}."
                )
            jump = ratio(new, largest) if largest > 0 else None
            if not req.force and largest > 0 and (jump is None or jump > MAX_JUMP):
                raise ActionError(
                    f"a learning rate of {new:g} for {where} is "
                    + (f"{jump:.3g}x" if jump is not None else "many times")
                    + f" the largest rate {f.name} uses now or started from ({largest:g}), past the {MAX_JUMP:g}x a "
                    "run usually survives; give --force if you mean it."
                )


def _reference(opt, pgs: list, rates: list) -> float:
    """The largest rate a new one is compared with for a jump: the rates the next step uses, the loop's own
    (between steps ``param_groups`` holds it; a scheduler's scaled rate with the scale divided back out), and
    the rate its scheduler started from (``initial_lr``, likewise). A rate below the smallest normal number
    of its group's dtype counts as 0 (no rate to compare with, as a warm-up from 0), so no ratio is taken
    over a denormal or zero, and going back to the loop's own rate after a tiny one is no jump."""
    with lock:
        ov = overrides.get(id(opt))
    rescaled = ov.rescaled if ov is not None and ov.ref() is opt else {}
    largest = 0.0
    for i, g in enumerate(pgs):
        found = [rates[i]]
        for v in (g.get("lr"), g.get("initial_lr")):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                found.append(float(v))
                r = rescaled.get(i)
                if r is not None:
                    found.append(ratio(float(v), r.factor) or 0.0)
        floor = dtype_floor(g)[0]
        largest = max([largest] + [x for x in found if math.isfinite(x) and x >= floor])
    return largest


def change_lr(ctx: Context, req: LrRequest) -> dict:
    """Install (or compose) the override, or write once; the action settles at the next step."""
    set_to, scale, group, once = req.set_to, req.scale, req.group, req.once
    opts = _pick(req.optimizer, group)
    if set_to is not None or scale is not None:  # the rates may have moved since the request was checked
        check_rate(req)
    for f in opts:
        for i in range(len(f.obj.param_groups)) if group is None else [group]:
            if hasattr(f.obj.param_groups[i]["lr"], "fill_") and getattr(f.obj.param_groups[i]["lr"], "is_cuda", False):
                raise ActionError(
                    f"group {i} of {f.name} keeps its lr as a CUDA tensor; probe changes only CPU rates "
                    "(reading it each step would synchronise the GPU)."
                )
    settle = ctx.defer()
    result = {
        "step": ctx.step,
        "mode": "once" if once else "hold",
        "optimizers": [],
        "waiting": "no step of the optimizer followed within the action's timeout, so the new lr was not seen used; "
        "the override stays installed (torch.optimizer shows it).",
    }
    if ctx.action is not None:
        ctx.action.result = result
    done = _settle_once(settle, result, len(opts))  # one count for the action, shared by its optimizers
    for f in opts:
        opt = f.obj
        groups = list(range(len(opt.param_groups))) if group is None else [group]
        rows = []
        with lock:
            ov = overrides.get(id(opt))
            if ov is not None and ov.ref() is not opt:
                ov = None  # a dead optimizer's id reused
            if ov is None:
                ov = Override(opt, f.name)
                hold(opt, ov)
            for i in groups:
                loop = value(opt.param_groups[i]["lr"])
                g = ov.groups.get(i)
                sched = rescalable(opt, i) if not once and g is None else None
                # into the scheduler's numbers only by a factor that can be divided out again and that keeps
                # every one of them a usable number (a 0 or a denormal would stay there: StepLR multiplies it on)
                factor = (scale if set_to is None else ratio(set_to, loop)) if sched is not None else None
                r = ov.rescaled.get(i)
                total = factor * (r.factor if r is not None else 1.0) if invertible(factor) else None
                limit = dtype_limit(opt.param_groups[i])
                if invertible(total) and rescale(
                    sched, opt.param_groups[i], i, factor, limit=limit[0] if limit is not None else math.inf
                ):
                    ov.rescaled[i] = Rescaled(
                        sched, total, ctx.step, f"set {set_to:g}" if set_to is not None else f"scale {total:g}"
                    )
                    rows.append(
                        {
                            "group": i,
                            "before": loop,
                            "after": value(opt.param_groups[i]["lr"]),
                            "loop_before": loop,
                            "via": "scheduler",
                            "status": f"{type(sched).__name__}'s base rate scaled; waiting for the next step",
                        }
                    )
                    continue
                before = g.target(loop) if g is not None else loop
                if g is not None:
                    g.hand_over(f"changed by action {ctx.action_id} at step {ctx.step}")
                if once:
                    after = set_to if set_to is not None else before * scale
                    if g is not None:
                        del ov.groups[i]  # a one-off write replaces a held override
                    write(opt.param_groups[i], after)
                elif g is None:
                    g = ov.groups[i] = Group(
                        "set" if set_to is not None else "scale",
                        set_to if set_to is not None else scale,
                        loop,
                        ctx.step,
                    )
                    after = g.target(loop)
                elif set_to is not None:
                    g.mode, g.value = "set", set_to
                    after = g.target(loop)
                else:  # a scale on top of an override composes with it
                    g.value = g.value * scale
                    after = g.target(loop)
                if g is not None:
                    limit = dtype_limit(opt.param_groups[i])
                    g.limit = limit[0] if limit is not None else math.inf
                row = {
                    "group": i,
                    "before": before,
                    "after": after,
                    "loop_before": loop,
                    "status": "waiting for the next step",
                }
                if not once:
                    g.rows = [row]
                rows.append(row)
            ov.pending.append((done, result, once, rows))
        result["optimizers"].append(
            {
                "optimizer": f.name,
                "type": type(opt).__name__,
                "wrapper": f.wrapper,
                "groups": rows,
                "via": "scheduler"
                if rows and all(x.get("via") == "scheduler" for x in rows)
                else ("once" if once else "hold"),
                # whether anything but the loop's own code rewrites the rate: the reply says why a hold holds
                "scheduler": next((type(s.obj).__name__ for s in scheduler_for(opt)), None),
            }
        )
    return result


def _settle_once(settle, result: dict, count: int):
    """One settle per action: after the last of its ``count`` optimizers has stepped."""
    left = [count]

    def done(error=None):
        left[0] -= 1
        if left[0] <= 0:
            result.pop("waiting", None)
            settle(error)

    return done


def reset_lr(ctx: Context, req: LrRequest) -> dict:
    """Remove overrides; the loop's own rate (already in param_groups between steps) applies from the next step."""
    group = req.group
    opts = _pick(req.optimizer, group) if req.optimizer is not None or group is not None else optimizers()
    removed = []
    for f in opts:
        with lock:
            ov = overrides.get(id(f.obj))
            if ov is None or ov.ref() is not f.obj:
                continue
            for i in [group] if group is not None else sorted(ov.rescaled):
                r = ov.rescaled.pop(i, None)
                sched = r.sched() if r is not None else None
                if sched is not None:
                    rescale(sched, f.obj.param_groups[i], i, r.factor, undo=True)
                    held = ctx.step - r.since if ctx.step is not None and r.since is not None else None
                    removed.append(_removed(f, i, r.text(), held, 0))
            for i in [group] if group is not None else list(ov.groups):
                g = ov.groups.pop(i, None)
                if g is not None:
                    g.hand_over(f"removed by action {ctx.action_id} at step {ctx.step}")
                    removed.append(_removed(f, i, g.text(), g.held, g.rewrites))
            if not ov.groups and not ov.rescaled and not ov.pending:
                drop(id(f.obj))
    if not removed:
        raise ActionError("there is no lr override to remove" + (" for that optimizer/group" if opts else "") + ".")
    return {"step": ctx.step, "removed": removed}


def _removed(found, group: int, override: str, held_steps, rewrites: int) -> dict:
    """What ``reset_lr`` reports of one override it removed (the loop's rate is what applies from now on)."""
    return {
        "optimizer": found.name,
        "group": group,
        "override": override,
        "held_steps": held_steps,
        "rewrites": rewrites,
        "loop_lr": value(found.obj.param_groups[group]["lr"]),
    }


# -- what a group's dtype can take ----------------------------------------------------------------
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
