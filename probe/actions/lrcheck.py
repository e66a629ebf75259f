"""Checking that an lr change took effect, at the optimizer's next step (for the lr action, ``lr``).

An action's result is settled only once a step has run: ``check_once`` (``--once``: was the value
written still there when the step started?), ``check_rescaled`` (a scheduler-scaled group: is the
rate the step used the scheduler's?) and ``settle`` (which rate the step used, and whether the loop
rewrote its own rate meanwhile, so that the override was re-applied). The check is reported, never
assumed.
"""

from __future__ import annotations

from .lrgroup import apart, value

__all__ = ["check_once", "check_rescaled", "settle"]


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
