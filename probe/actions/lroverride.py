"""The lr overrides each optimizer holds: applied around each of its steps through the step boundary's
``before_step`` registration (``_around_step``, registered while an override exists), shown in torch.optimizer
(``describe``), installed and removed by the lr action (``lr``, which says how they hold).
"""

from __future__ import annotations

import math
import threading
import weakref

from .._errors import ActionError
from ..training.boundary import boundary
from ..util.errorlog import record_error
from . import lrcheck
from .lrgroup import Rescaled, value, write

__all__ = ["Group", "Override", "lock", "overrides", "hold", "drop", "describe", "next_rates"]

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
            lrcheck.check_once(item, pgs, step)
            lrcheck.check_rescaled(self.rescaled, item, pgs, step)

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
            lrcheck.settle(self.groups, item, step)
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
