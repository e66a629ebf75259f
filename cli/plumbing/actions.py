"""Sending guarded actions and waiting for them: one process, or several at one common step.

Each action is one request answered at once with its id (so Ctrl-C can cancel it), then polled
until it ends (progress on stderr while one process's action is queued). Several processes
(``--ranks``) are asked to act at the same step, one no rank has reached yet (``common_step``);
a rank that had passed it anyway does nothing, and all are asked again later (``drive_many``).
The commands (``cli.commands``) build the bodies, confirm and render.
"""

from __future__ import annotations

import math
import time

from probe._errors import ProbeError


STEP_MARGIN = 2  # the fewest steps ahead a common step is chosen
LEAD_S = 0.5  # ... and the least time ahead (see common_step)
RETRIES = 3  # asking again when a rank had passed the step before its request came
POLL = 2.0  # seconds each wait request waits in the process before answering


def common_step(session, targets, attempt: int = 0) -> int | None:
    """A step no rank has reached yet, far enough ahead that every rank's request arrives before it.

    The largest step any rank has reached, plus the steps the fastest rank makes in the lead time:
    ``LEAD_S``, or three times what asking every rank took if that is longer, doubled at each
    ``attempt``; never fewer than ``STEP_MARGIN``. None when no rank answers.
    """

    def step(t):
        try:
            h = session.client(t).get("/health", timeout=min(session.timeout, 5.0))
        except ProbeError:
            return None
        s = h.get("step")
        s = s if isinstance(s, int) else h.get("safepoint_step")
        return (s if isinstance(s, int) else 0, h.get("step_time"))  # 0: no step yet

    from .fanout import parallel

    started = time.monotonic()
    known = [a for a in parallel(targets, step) if a is not None]
    if not known:
        return None
    lead = max(LEAD_S, 3 * (time.monotonic() - started)) * 2**attempt
    times = [t for _, t in known if isinstance(t, (int, float)) and t > 0]
    margin = max(STEP_MARGIN * 2**attempt, math.ceil(lead / min(times)) if times else 0)
    return max(s for s, _ in known) + margin


def drive_many(session, name: str, targets, bodies, queued: bool) -> list:
    """Submit to every target at one common step and wait for all; outcomes in target order.

    A rank that had passed the step before its request came fails it with ``missed_step``, having
    done nothing; the ranks that accepted it are then cancelled and all are asked again at a later
    step (up to ``RETRIES`` times, then none does it), so the action never runs at different steps
    on different ranks, nor on some ranks only because one missed.
    """
    from concurrent.futures import ThreadPoolExecutor  # not on the CLI's start-up path

    pool = ThreadPoolExecutor(max_workers=min(64, len(targets)))
    try:
        for attempt in range(RETRIES + 1):
            at_step = common_step(session, targets, attempt) if queued else None
            sent = [dict(b, at_step=at_step) if at_step is not None else b for b in bodies]
            first = list(pool.map(lambda tb: send(session, name, tb[0], tb[1]), zip(targets, sent)))
            missed = [t.label for t, a in zip(targets, first) if isinstance(a, dict) and a.get("missed_step")]
            if not missed:
                break
            accepted = [(t, a) for t, a in zip(targets, first) if isinstance(a, dict) and not a.get("missed_step")]
            dropped = list(pool.map(lambda ta: _dropped(session, ta[0], ta[1]), accepted))
            passed = f"probe: {', '.join(missed)} had passed step {at_step} before the request came; "
            if not all(dropped):  # one already ran at the step: asking again would run it twice there
                session.note(passed + "the others could not all be cancelled, so it is not asked again.")
                break
            if attempt == RETRIES:  # all or none: a change on some ranks only (an lr) would set them apart
                session.note(passed + f"cancelled on the others after {RETRIES + 1} tries: no rank did it.")
                break
            session.note(passed + "cancelled on the others, asking every rank again at a later step.")
        return list(pool.map(lambda ta: wait_for(session, ta[0], ta[1], False), zip(targets, first)))
    except KeyboardInterrupt:
        raise ProbeError(
            "interrupted; the actions go on in the training processes (see probe.actions; "
            "`probe --rank N cancel ID` cancels one).",
            exit_code=130,
        ) from None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def send(session, name: str, target, body: dict):
    """Submit without waiting: the action dict (its id, so it can be cancelled), or the ProbeError."""
    try:
        return session.client(target).post(f"/actions/{name}", {**body, "wait": 0}, timeout=session.timeout)["action"]
    except ProbeError as exc:
        return exc


def cancel(session, target, action: dict) -> dict:
    """Ask the process to cancel the action (a queued one is dropped, a running ``--now`` one interrupted);
    the action as it is afterwards. Raises ProbeError when the process cannot be asked or refuses."""
    return session.client(target).post(
        "/actions/cancel", {"id": action["id"], "wait": 2.0}, timeout=5.0 + session.timeout
    )["action"]


def _dropped(session, target, action: dict) -> bool:
    """True when the queued action is cancelled: it never ran."""
    try:
        return cancel(session, target, action)["state"] == "cancelled"
    except ProbeError:
        return False


def wait_for(session, target, action, single: bool):
    """Poll until the action ends; the final action dict, or the ProbeError that stopped it."""
    if isinstance(action, ProbeError):
        return action
    client = session.client(target)
    try:
        started, last_note = time.monotonic(), time.monotonic()
        while action["state"] in ("queued", "running"):
            if single and time.monotonic() - last_note >= 5.0:
                last_note = time.monotonic()
                progress(session, action, time.monotonic() - started)
            action = client.get("/actions/wait", timeout=POLL + session.timeout, id=action["id"], wait=POLL)["action"]
        return action
    except ProbeError as exc:
        return exc


def drive(session, name: str, target, body: dict):
    """Submit to one process and wait, with progress notes; return the final action dict, or the ProbeError that
    stopped it. Ctrl-C cancels it."""
    action = None
    try:
        # answered at once with the action's id (so Ctrl-C can cancel it from then on), then waited for below
        action = send(session, name, target, body)
        return wait_for(session, target, action, True)
    except KeyboardInterrupt:
        if not isinstance(action, dict):
            raise ProbeError(
                "interrupted before the process confirmed the action; see probe.actions.", exit_code=130
            ) from None
        try:  # Ctrl-C cancels what we started: a queued action is dropped, a running --now eval interrupted
            done = cancel(session, target, action)
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


def progress(session, action: dict, waited: float) -> None:
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
