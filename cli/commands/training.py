"""The commands that change how the job trains, each at the next step boundary and checked there: ``probe lr``
(change the learning rate from the next optimizer step on, held against the scheduler) and ``probe guard`` (arm a
safety net: skip or roll back a bad step and keep its evidence; or show what is armed)."""

from __future__ import annotations

import json
import os

from . import command
from .actions import _Action, _bytes


@command(
    "lr",
    "Change the learning rate from the next optimizer step on, held against the loop's scheduler or "
    "hand-written schedule, and checked at that step.",
)
class Lr(_Action):
    @staticmethod
    def add_arguments(p):
        g = p.add_mutually_exclusive_group(required=True)
        g.add_argument("--set", type=float, metavar="LR", help="Every step uses this learning rate.")
        g.add_argument("--scale", type=float, metavar="F", help="Every step uses the loop's own learning rate times F.")
        g.add_argument("--reset", action="store_true", help="Remove the override: the loop's own rate applies again.")
        p.add_argument("--group", type=int, metavar="N", help="Only param group N (default: every group).")
        p.add_argument(
            "--optimizer",
            metavar="NAME",
            help="Only this optimizer, when there are several: its name in "
            "torch.optimizer (opt_d, trainer.optimizer) or its index there (0, 1, ...).",
        )
        p.add_argument(
            "--once",
            "--ignore-scheduler",
            dest="once",
            action="store_true",
            help="Write param_groups once without holding it (the next step is still checked: it fails "
            "if the loop rewrote the rate first).",
        )
        p.add_argument(
            "--force",
            action="store_true",
            help="Allow a rate more than 10x the largest one in use now (never one the parameters' dtype cannot take).",
        )
        p.add_argument("--allow-zero", action="store_true", help="Allow a rate of 0 (the weights stop changing).")
        _Action.add_common(p)

    def body(self, session, args, target):
        b = {
            "now": args.now,
            "once": args.once,
            "reset": args.reset,
            "force": args.force,
            "allow_zero": args.allow_zero,
        }
        for k in ("set", "scale", "group", "optimizer"):
            if getattr(args, k) is not None:
                b[k] = getattr(args, k)
        if isinstance(b.get("optimizer"), str) and b["optimizer"].isdigit():
            b["optimizer"] = int(b["optimizer"])  # an index; anything else is a name
        return b

    def describe(self, args):
        if args.reset:
            return "lr --reset"
        return f"lr --set {args.set:g}" if args.set is not None else f"lr --scale {args.scale:g}"

    def render(self, session, target, action, prefix):
        r = action.get("result") or {}
        for g in r.get("removed", []):
            when = "the next step" if r.get("step") is None else f"step {r['step'] + 1}"
            after = "" if g.get("held_steps") is None else f" after {g['held_steps']} step(s)"
            session.print(
                f"{prefix}optimizer '{g['optimizer']}' group {g['group']}: removed {g['override']}{after}; "
                f"the loop's lr {g['loop_lr']:.6g} applies from {when}."
            )
        for opt in r.get("optimizers", []):
            via = f" (through {opt['wrapper']})" if opt.get("wrapper") else ""
            held = _how_held(r, opt)
            session.print(
                f"{prefix}optimizer '{opt['optimizer']}' {opt.get('type', '')}{via}, {held}"
                + ("" if r.get("step") is None else f", from step {r['step'] + 1}")
                + ":"
            )
            for g in opt["groups"]:
                used = g.get("used")
                check = (
                    f"; step {r['checked_at_step']} used {used:.6g}"
                    if used is not None and r.get("checked_at_step")
                    else "; not yet seen used"
                )
                session.print(
                    f"{prefix}  group {g['group']}: {g['before']:.6g} -> {g['after']:.6g}{check}"
                    + (f" ({g['note']})" if g.get("note") else "")
                )


def _how_held(r: dict, opt: dict) -> str:
    """How the change holds, as far as the first step that used it showed: through the scheduler's base rates,
    held against a loop or scheduler that rewrites the rate, or simply kept where nothing rewrote it."""
    if r.get("mode") == "once":
        return "written once"
    if opt.get("via") == "scheduler":
        return "through its scheduler's base rates (param_groups and the loop's logs show the new rate)"
    shown = (
        "param_groups and the loop's own logs show the loop's value between steps, torch.steps.lr what each step used"
    )
    rewrote = any(g.get("note") for g in opt.get("groups", ()))
    if r.get("checked_at_step") and not rewrote and not opt.get("scheduler"):
        return (
            f"kept: nothing rewrote the loop's rate before step {r['checked_at_step']} and no scheduler drives it, so "
            "the new rate stays in use; probe applies it again on top only if the loop or a scheduler rewrites the "
            f"rate ({shown})"
        )
    who = f"its {opt['scheduler']}" if opt.get("scheduler") else "the loop"
    return f"held at every step ({who} rewrites the rate; the override is applied on top of each new value: {shown})"


@command(
    "guard",
    "Arm a guard at the next step boundary: on a non-finite loss or gradient, or a spike, keep the evidence (the "
    "batch, the state before the step) and skip the update or roll back; with no option, show what is armed and "
    "what it caught.",
)
class Guard(_Action):
    @staticmethod
    def add_arguments(p):
        p.add_argument(
            "--on",
            metavar="TRIGGERS",
            help="Comma-separated triggers: nonfinite (a NaN or inf loss or gradient), spike=N (a gradient norm above "
            "N times its recent median), loss=N (a loss above N times its recent median). Default: nonfinite.",
        )
        p.add_argument(
            "--keep",
            type=int,
            metavar="N",
            help="Keep the last N steps' batches (the model's inputs, copied to the host) for the evidence "
            "(default 1). The memory this costs is checked before arming.",
        )
        p.add_argument(
            "--skip",
            action="store_true",
            help="On a trigger, skip the update: gradients zeroed, the optimizer and scheduler steps not taken.",
        )
        p.add_argument(
            "--rollback",
            action="store_true",
            help="Copy the weights and optimizer state to the host before each step; on a trigger with weights no "
            "longer finite, restore the copy from before the previous step and skip this one.",
        )
        p.add_argument(
            "--evidence",
            metavar="DIR",
            help="Write an evidence bundle per trigger into DIR (load it with probe.load_evidence(path)).",
        )
        p.add_argument("--off", action="store_true", help="Take the guard out: every wrapper and hook removed.")

    def queued(self, args) -> bool:
        return True

    def body(self, session, args, target):
        b = {"skip": args.skip, "rollback": args.rollback}
        if args.off:  # alone; anything given with it goes along, for the process to refuse in one sentence
            b = {"off": True, **{k: v for k, v in b.items() if v}}
        for k in ("on", "keep", "evidence"):
            if getattr(args, k) is not None:
                b[k] = getattr(args, k)
        if args.evidence and target.socket:  # relative to where the user runs probe, for a local process
            b["evidence"] = os.path.abspath(os.path.expanduser(args.evidence))
        return b

    def describe(self, args):
        if args.off:
            return "guard --off"
        return (
            "guard"
            + "".join(f" --{k} {getattr(args, k)}" for k in ("on", "keep", "evidence") if getattr(args, k) is not None)
            + (" --skip" if args.skip else "")
            + (" --rollback" if args.rollback else "")
        )

    def run(self, session, args) -> int:
        arming = (
            args.off
            or args.skip
            or args.rollback
            or any(getattr(args, k) is not None for k in ("on", "keep", "evidence"))
        )
        if arming:
            return super().run(session, args)
        targets = session.targets()
        docs = [(t, session.client(t).get("/guard", timeout=session.timeout)["guard"]) for t in targets]
        if session.format == "json":
            session.print(json.dumps([{"target": t.label, "rank": t.rank, **d} for t, d in docs], indent=2))
            return 0
        for t, d in docs:
            prefix = "" if len(docs) == 1 else f"[{t.label}] "
            session.print(
                f"{prefix}guard: {'armed ' + d['armed'] if d['armed'] else 'not armed'}"
                + (f"; checked {d['checked']} step(s)" if d["armed"] else "")
                + f"; caught {d['events']}."
            )
            for e in d["caught"]:
                where = f"; evidence {e['evidence']}" if e.get("evidence") else ""
                if e.get("first_nonfinite") is not None:
                    where = f"; first non-finite output: {e['first_nonfinite'] or 'the model'}" + where
                session.print(f"{prefix}  step {e['step']}: {e['reason']}: {e['taken']}{where}")
        return 0

    def render(self, session, target, action, prefix):
        r = action.get("result") or {}
        if action["state"] != "done":
            return
        if "was" in r or r.get("armed") is None:
            session.print(
                f"{prefix}guard off at step {r.get('step')}"
                + (
                    f" (was {r['was']}; caught {r['caught']}; hooks left {r.get('hooks_left', 0)})."
                    if r.get("was")
                    else ": it was not armed."
                )
            )
            return
        keep = (
            f"; holds up to {_bytes(r['state_bytes'] + r['batch_bytes_max'])} on the host (state "
            f"{_bytes(r['state_bytes'])}, batches at most {_bytes(r['batch_bytes_max'])})"
            if r.get("state_bytes") or r.get("batch_bytes_max")
            else ""
        )
        session.print(
            f"{prefix}guard armed at step {r.get('step')}: {r['armed']} on {', '.join(r['optimizers'])}"
            + (f" (model {r['model']})" if r.get("model") else "")
            + keep
            + "."
        )
