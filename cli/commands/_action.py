"""What the guarded action commands share (eval, checkpoint, lr, cleanup, debug): the flow.

Each command builds one request body per target; with several targets (``--ranks``) it asks
for confirmation unless ``--yes``. ``cli.plumbing.actions`` sends the requests (every rank at
one common step) and waits for the outcomes, which the command then renders.
"""

from __future__ import annotations

import json
import sys

from probe._errors import ActionError, PartialError, ProbeError

from ..plumbing.actions import drive, drive_many
from . import Command


_NOW_RISK = {
    "checkpoint": (
        "--now writes the checkpoint from the server thread while training may be mid-step: weights and optimizer "
        "state can come from different sides of an update."
    ),
    "lr": (
        "--now changes the learning rate from the server thread: an optimizer step running right now may use the old "
        "rate for some parameters and the new one for others."
    ),
    "cleanup": (
        "--now runs gc and empty_cache from the server thread while training runs; --zero-grad may drop gradients a "
        "step is about to use."
    ),
    "eval": (
        "--now runs the code on the server thread while training runs: reading is fine, but changing state can race "
        "with the step in progress."
    ),
    "debug": "",
}


class _Action(Command):
    """Shared flow: build the body, confirm, submit to every target, wait, render."""

    queued_by_default = True

    @staticmethod
    def add_common(
        p,
        now_help: str = (
            "Run at once on the probe's server thread instead of at the next step boundary (for a hung process)."
        ),
    ) -> None:
        p.add_argument("--now", action="store_true", help=now_help)

    def body(self, session, args, target) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self, args) -> str:
        return self.name

    def render(self, session, target, action: dict, prefix: str) -> None:
        session.print(f"{prefix}{json.dumps(action.get('result'), indent=2, default=str)}")

    def queued(self, args) -> bool:
        return not getattr(args, "now", False)

    def run(self, session, args) -> int:
        targets = session.targets()
        if getattr(args, "now", False) and _NOW_RISK.get(self.name):
            session.note(f"probe: warning: {_NOW_RISK[self.name]}")
        if len(targets) > 1:
            self.check_many(session, args, targets)
            _confirm(
                session,
                args,
                f"`{self.describe(args)}` to {len(targets)} processes ({_labels(targets)})"
                + (", at the same step on each" if self.queued(args) else ""),
            )
        bodies = []
        for t in targets:
            b = self.body(session, args, t)
            if self.queued(args) and args.timeout:
                b["timeout"] = args.timeout  # else the process's PROBE_ACTION_TIMEOUT
            bodies.append(b)
        single = len(targets) == 1
        if single:  # on the main thread, where Ctrl-C lands: it cancels the action (see drive)
            outcomes = [drive(session, self.name, targets[0], bodies[0])]
        else:
            outcomes = drive_many(session, self.name, targets, bodies, self.queued(args))
        if session.format == "json":
            session.print(
                json.dumps(
                    [
                        {
                            "target": t.label,
                            "rank": t.rank,
                            "pid": t.pid,
                            **({"action": o} if isinstance(o, dict) else {"error": o.message}),
                        }
                        for t, o in zip(targets, outcomes)
                    ],
                    indent=2,
                    default=str,
                )
            )
        failures = []
        for t, o in zip(targets, outcomes):
            prefix = "" if single else f"[{t.label}] "
            if isinstance(o, ProbeError):
                failures.append(o)
                if session.format != "json":
                    session.note(f"probe: {prefix}{o.message}")
                continue
            if session.format != "json":
                self.render(session, t, o, prefix)
            if o["state"] != "done":
                err = ActionError(_failure_text(o))
                failures.append(err)
                if session.format != "json":
                    session.note(f"probe: {prefix}{err.message}")
        if not failures:
            return 0
        if len(failures) < len(targets):
            return PartialError.exit_code  # some ranks succeeded and some did not
        return failures[0].exit_code

    def check_many(self, session, args, targets) -> None:
        pass


def _labels(targets) -> str:
    return ", ".join(t.label for t in targets[:8]) + (" ..." if len(targets) > 8 else "")


def _confirm(session, args, what: str) -> None:
    if getattr(args, "yes", False):
        return
    if not sys.stdin.isatty():
        raise ProbeError(f"this sends {what}; add --yes to confirm, since there is no terminal to ask on.")
    try:
        answer = input(f"Send {what}? [y/N] ")
    except EOFError:
        answer = ""
    if answer.strip().lower() not in ("y", "yes"):
        raise ProbeError("cancelled; nothing was sent.")


def _failure_text(action: dict) -> str:
    if action["state"] == "timed_out":
        return f"action {action['id']} timed out: {action.get('error')}"
    if action["state"] in ("queued", "running"):
        return f"action {action['id']} is still {action['state']}."
    if action["state"] == "cancelled":
        return f"action {action['id']} ({action['command']}) was cancelled: {action.get('error')}"
    return f"action {action['id']} ({action['command']}) failed: {action.get('error')}"


def _local(target) -> bool:
    return bool(target.socket)


def _bytes(n) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
