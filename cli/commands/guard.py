"""``probe guard``: arm a safety net on a live job (skip or roll back a bad step, keep its evidence), or show it."""

from __future__ import annotations

import json
import os

from . import command
from .actions import _Action, _bytes


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
