"""What the guarded actions share (eval, checkpoint, lr, cleanup, debug; and profile-steps's waiting).

Each command sends one request per target, then waits for the action's outcome
(progress on stderr while it is queued). With several targets (``--ranks``) it asks
for confirmation unless ``--yes``, and asks every rank to act at the same step: the
largest current step across ranks plus a small margin.
"""

from __future__ import annotations

import json
import sys
import time

from probe._errors import ActionError, PartialError, ProbeError

from . import Command

STEP_MARGIN = 2
POLL = 2.0

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
        at_step = None
        if len(targets) > 1:
            self.check_many(session, args, targets)
            if self.queued(args) and at_step is None:
                at_step = _common_step(session, targets)
            _confirm(
                session,
                args,
                f"`{self.describe(args)}` to {len(targets)} processes ({_labels(targets)})"
                + (f" at step {at_step}" if at_step is not None else ""),
            )
        bodies = []
        for t in targets:
            b = self.body(session, args, t)
            if self.queued(args):
                if args.timeout:
                    b["timeout"] = args.timeout  # else the process's PROBE_ACTION_TIMEOUT
                if at_step is not None:
                    b["at_step"] = at_step
            bodies.append(b)
        single = len(targets) == 1
        if single:  # on the main thread, where Ctrl-C lands: it cancels the action (see _drive)
            outcomes = [_drive(session, self.name, targets[0], bodies[0], True)]
        else:
            from concurrent.futures import ThreadPoolExecutor  # not on the CLI's start-up path

            pool = ThreadPoolExecutor(max_workers=min(64, len(targets)))
            try:
                outcomes = list(
                    pool.map(lambda tb: _drive(session, self.name, tb[0], tb[1], single), zip(targets, bodies))
                )
            except KeyboardInterrupt:
                raise ProbeError(
                    "interrupted; the actions go on in the training processes (see probe.actions; "
                    "`probe --rank N cancel ID` cancels one).",
                    exit_code=130,
                ) from None
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
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


def _common_step(session, targets) -> int | None:
    """The largest step any target has reached, plus a margin, so every rank acts at the same step."""

    def step(t):
        try:
            h = session.client(t).get("/health", timeout=min(session.timeout, 5.0))
        except ProbeError:
            return None
        s = h.get("step")
        return s if isinstance(s, int) else h.get("safepoint_step")

    from ..plumbing.fanout import parallel

    steps = [s for s in parallel(targets, step) if isinstance(s, int)]
    return max(steps) + STEP_MARGIN if steps else None


def _failure_text(action: dict) -> str:
    if action["state"] == "timed_out":
        return f"action {action['id']} timed out: {action.get('error')}"
    if action["state"] in ("queued", "running"):
        return f"action {action['id']} is still {action['state']}."
    return f"action {action['id']} ({action['command']}) failed: {action.get('error')}"


def _drive(session, name: str, target, body: dict, single: bool):
    """Submit and wait; return the final action dict, or the ProbeError that stopped it."""
    client = session.client(target)
    action = None
    try:
        # answered at once with the action's id (so Ctrl-C can cancel it from then on), then waited for below
        doc = client.post(f"/actions/{name}", {**body, "wait": 0}, timeout=session.timeout)
        action = doc["action"]
        started, last_note = time.monotonic(), time.monotonic()
        while action["state"] in ("queued", "running"):
            if single and time.monotonic() - last_note >= 5.0:
                last_note = time.monotonic()
                _progress(session, action, time.monotonic() - started)
            action = client.get("/actions/wait", timeout=POLL + session.timeout, id=action["id"], wait=POLL)["action"]
        return action
    except KeyboardInterrupt:
        if action is None:
            raise ProbeError(
                "interrupted before the process confirmed the action; see probe.actions.", exit_code=130
            ) from None
        try:  # Ctrl-C cancels what we started: a queued action is dropped, a running --now eval interrupted
            done = client.post("/actions/cancel", {"id": action["id"], "wait": 2.0}, timeout=5.0 + session.timeout)[
                "action"
            ]
        except ProbeError as exc:
            raise ProbeError(
                f"interrupted; action {action['id']} could not be cancelled ({exc.message.rstrip('.')}) "
                "and goes on in the training process (see probe.actions).",
                exit_code=130,
            ) from None
        raise ProbeError(
            f"interrupted; action {action['id']} is {done['state']}"
            + (" (it stops at its next Python instruction)." if done["state"] == "running" else "."),
            exit_code=130,
        ) from None
    except ProbeError as exc:
        return exc


def _progress(session, action: dict, waited: float) -> None:
    if action["state"] == "queued":
        where = f"step {action['at_step']}" if action.get("at_step") is not None else "the next step boundary"
        last = action.get("last_step")
        session.note(
            f"probe: action {action['id']} queued {waited:.0f} s, waiting for {where}"
            + (f" (last step {last})" if last is not None else " (no step seen yet)")
            + (f"; it is dropped after {action['timeout']:g} s" if action.get("timeout") else "")
            + "."
        )
    else:
        session.note(
            f"probe: action {action['id']} running for {time.time() - (action.get('started_at') or time.time()):.0f} s."
        )


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
