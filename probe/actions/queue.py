"""Guarded actions: an id, a state, and a run at the step boundary (docs/actions.md: when each runs).

A queued action that has not started by its deadline becomes ``timed_out`` under the same lock
the training thread takes to start it, so a timed-out action can never run late. One given a
step (``at_step``) runs at that step's safe point or not at all: if the step has passed it fails
with ``missed`` set. A ``now`` action runs on a thread of its own (``probe-action-ID``); the
request waits for it as for a queued one, so the client always learns the id. ``cancel`` drops
a queued action and raises an exception in a ``now`` action's thread at its next Python
instruction; an action running on the training thread is never interrupted.

Every submission, refusal and outcome is written to the audit log; the last
``CAPACITY`` actions are kept for the ``probe.actions`` table.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .._core.boundary import StepEvent, boundary
from .._core.audit import audit
from .._errors import ActionError, ProbeError
from ..util.errorlog import record_error


CAPACITY = 1000
TERMINAL = ("done", "failed", "timed_out", "cancelled")


class ActionCancelled(BaseException):
    """Raised inside a running ``now`` action (eval'd code) by ``cancel``; a BaseException so that the
    eval'd code's own ``except Exception`` does not swallow it."""


@dataclass
class Context:
    """What an action's function receives: the step boundary it runs at, if any.

    An action whose effect can only be checked later (an lr change, at the next optimizer
    step) calls ``defer()``: it then stays ``running`` after its function returns, until the
    returned ``settle(error=None)`` is called (from the training thread, say), or its timeout
    passes (``failed``, with the reason). Its result dict may be updated in place meanwhile.
    """

    step: int | None
    frame: Any = None
    optimizer: Any = None
    now: bool = False
    action_id: int = 0
    deferred: bool = False
    action: Any = None

    def defer(self) -> Callable[..., None]:
        self.deferred = True
        a = self.action
        if a is not None:
            a.settle_by = time.time() + (a.timeout or 60.0)
        action_id = self.action_id
        return lambda error=None: settle(action_id, error)


@dataclass
class Action:
    id: int
    command: str
    args: dict
    client: dict
    fn: Callable[[Context], dict] = field(repr=False)
    now: bool = False
    at_step: int | None = None
    timeout: float | None = None
    state: str = "queued"
    requested_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    step: int | None = None
    result: dict | None = None
    error: str | None = None
    thread: int | None = field(default=None, repr=False)  # ident of the thread running a ``now`` action
    cancel_requested: bool = field(default=False, repr=False)  # a cancel that came before that thread started
    settle_by: float | None = None  # a deferred action not settled by then fails
    missed: bool = False  # failed because its ``at_step`` had passed: never ran, safe to ask again
    timer: Any = field(default=None, repr=False)  # the threading.Timer that expires it when queued with a timeout

    def to_dict(self) -> dict:
        return {
            **{name: getattr(self, name) for name in _SHOWN},
            "queued_for": (self.started_at or time.time()) - self.requested_at,
            "last_step": boundary.last_step,
            "missed_step": self.missed,
        }


# what a client is shown of an action (the client itself, the function and the thread machinery are not)
_SHOWN = "id command args state now at_step timeout requested_at started_at finished_at step result error".split()
_ids = itertools.count(1)
_lock = threading.Condition(threading.RLock())
_history: deque[Action] = deque(maxlen=CAPACITY)
_pending: list[Action] = []  # while non-empty, _at_step is subscribed to the step boundary


def last_step() -> int | None:
    """The step of the last safe point this process passed, or None before the first one."""
    return boundary.last_step


def actions() -> list[Action]:
    expire()
    with _lock:
        return list(_history)


def get(action_id: int) -> Action:
    with _lock:
        for a in _history:
            if a.id == action_id:
                return a
    raise ActionError(
        f'no action with id {action_id} in this process; `probe ENDPOINT query "SELECT * FROM probe.actions"` lists '
        "them."
    )


def refuse(client: dict, command: str, args: dict, reason: str) -> None:
    """Audit a refusal, then raise it as one sentence."""
    audit(client, command, args, "refused", reason=reason)
    raise ActionError(reason)


def submit(
    command: str,
    fn: Callable[[Context], dict],
    *,
    args: dict,
    client: dict,
    now: bool = False,
    at_step: int | None = None,
    timeout: float | None = None,
) -> Action:
    """Queue ``fn`` for the next safe point (or run it now); return the tracked action."""
    action = Action(next(_ids), command, dict(args), dict(client), fn, now=now, at_step=at_step, timeout=timeout)
    with _lock:
        _history.append(action)
        passed = not now and at_step is not None and (boundary.last_step or 0) >= at_step
        if passed:
            _miss(action, boundary.last_step)
        elif not now:
            _pending.append(action)
            boundary.after_step(_at_step)  # subscribed only while something waits: an idle boundary costs nothing
    if passed:  # never queued: its one audit line says it failed, and why
        _audit_end(action)
        return action
    audit(client, command, args, "queued" if not now else "running", id=action.id, now=now, at_step=at_step)
    if now:
        t = threading.Thread(
            target=_run,
            args=(action, Context(step=boundary.last_step, now=True, action_id=action.id)),
            name=f"probe-action-{action.id}",
            daemon=True,
        )
        action.state = "running"
        t.start()
    elif timeout is not None:
        action.timer = threading.Timer(timeout, expire)
        action.timer.daemon = True
        action.timer.name = "probe-action-timeout"
        action.timer.start()
    return action


def drop_pending() -> None:
    """Cancel every action still waiting for a step boundary and stop their timers (the probe stopped): none of
    them runs later, and the boundary has no subscriber of ours left."""
    with _lock:
        dropped = list(_pending)
        _pending.clear()
        boundary.remove(_at_step)
        for a in dropped:
            a.state, a.finished_at, a.error = "cancelled", time.time(), "the probe stopped before a step boundary came."
        for a in _history:
            if a.timer is not None:
                a.timer.cancel()
                a.timer = None
        _lock.notify_all()
    for a in dropped:
        _audit_end(a)


def wait(action: Action, seconds: float) -> Action:
    """Block the calling (server) thread until the action ends or ``seconds`` pass."""
    deadline = time.monotonic() + max(0.0, seconds)
    with _lock:
        while action.state not in TERMINAL:
            expire()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            _lock.wait(min(left, 0.5))
    return action


def expire() -> None:
    """Mark queued actions past their deadline as timed_out; they are then never run."""
    now = time.time()
    expired = []
    with _lock:
        _expire_deferred(now)
        for a in list(_pending):
            if a.timeout is not None and now - a.requested_at >= a.timeout:
                _pending.remove(a)
                a.state, a.finished_at = "timed_out", now
                a.error = (
                    f"no step boundary was reached within {a.timeout:g} s"
                    + (
                        f" (waiting for step {a.at_step}, last step {boundary.last_step})"
                        if a.at_step is not None
                        else ""
                    )
                    + "; the action was dropped and will not run."
                )
                expired.append(a)
        if expired:
            _lock.notify_all()
    for a in expired:
        audit(a.client, a.command, a.args, "timed_out", id=a.id, error=a.error)


def cancel(action_id: int, client: dict) -> Action:
    """Cancel a queued action, or interrupt a running ``now`` one; raise ActionError when it cannot be."""
    import ctypes

    with _lock:
        action = get(action_id)
        if action.state in TERMINAL:
            raise ActionError(f"action {action_id} has already ended ({action.state}); nothing to cancel.")
        if action.state == "queued" or action in _pending:
            if action in _pending:
                _pending.remove(action)
            action.state, action.finished_at, action.error = "cancelled", time.time(), "cancelled before it started."
            _lock.notify_all()
        elif action.now and action.thread is None:  # its thread has not started the code yet: it stops there
            action.cancel_requested = True
        elif not action.now:
            raise ActionError(
                f"action {action_id} is running on the training thread at a step boundary; it cannot be "
                "interrupted there without hurting training, and ends when its code returns."
            )
        else:
            # raised at the thread's next Python instruction (a blocking C call, e.g. sleep, finishes first)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(action.thread), ctypes.py_object(ActionCancelled))
    audit(client, "cancel", {"id": action_id, "command": action.command}, "done", state=action.state)
    return action


def settle(action_id: int, error: str | None = None) -> None:
    """End a deferred action: ``done``, or ``failed`` with ``error``. A settled action stays settled."""
    with _lock:
        action = next((a for a in _history if a.id == action_id), None)
        if action is None or action.state != "running" or action.settle_by is None:
            return
        action.state = "failed" if error else "done"
        action.error = error
        action.settle_by = None
        action.finished_at = time.time()
        _lock.notify_all()
    _audit_end(action)


def _expire_deferred(now: float) -> None:
    for a in list(_history):
        if a.state == "running" and a.settle_by is not None and now >= a.settle_by:
            settle(a.id, (a.result or {}).get("waiting") or "its effect could not be checked before the timeout.")


def _miss(action: Action, last: int | None) -> None:
    """End an action whose ``at_step`` has passed (caller holds ``_lock``): it is never run at another step,
    since the other ranks asked run it at that one."""
    action.state, action.finished_at, action.missed = "failed", time.time(), True
    action.error = (
        f"it was to run at step {action.at_step}, which this process had passed (last step {last}); it did not "
        "run, so it can be asked again at a later step."
    )
    _lock.notify_all()


def _run(action: Action, ctx: Context) -> None:
    action.state, action.started_at, action.step = "running", time.time(), ctx.step
    ctx.action = action
    try:
        try:
            if ctx.now:
                with _lock:
                    action.thread = threading.get_ident()
                    if action.cancel_requested:
                        action.thread = None
                        raise ActionCancelled()
            try:
                result = action.fn(ctx) or {}
            finally:
                with _lock:  # cancel() injects only while this is set, under the same lock
                    action.thread = None
            if ctx.deferred:
                with _lock:
                    if action.result is None:
                        action.result = result
                    _lock.notify_all()
                audit(
                    action.client,
                    action.command,
                    action.args,
                    "applied",
                    id=action.id,
                    step=action.step,
                    result=_short(action.result),
                )
                return
            action.result = result
            action.state = "done"
        except ActionCancelled:
            action.state, action.error = "cancelled", "cancelled while it ran."
        except ProbeError as exc:
            action.state, action.error = "failed", exc.message
            action.result = getattr(exc, "result", None)
        except Exception as exc:
            record_error(f"action {action.command}", exc)
            action.state, action.error = "failed", f"{type(exc).__name__}: {exc}"
            action.result = getattr(exc, "result", None)
        except BaseException as exc:  # SystemExit or KeyboardInterrupt raised by eval'd code
            action.state, action.error = "failed", f"the code raised {type(exc).__name__}; the action was interrupted."
            if not ctx.now:
                raise  # on the training thread, as if the loop itself had raised it (a real Ctrl-C must stop training)
        finally:
            if not (ctx.deferred and action.error is None):  # a deferred action is settled later by settle()
                action.finished_at = time.time()
                with _lock:
                    _lock.notify_all()
                _audit_end(action)
    except ActionCancelled:  # a cancel that landed just as the action ended: it had finished anyway
        pass


def _short(result: dict | None) -> Any:
    try:
        text = json.dumps(result, default=repr)
    except Exception:
        return repr(result)[:2000]
    return result if len(text) <= 2000 else text[:2000] + "..."


def _audit_end(action) -> None:
    """The audit line of an action that ended: its state, step, error and (shortened) result."""
    audit(
        action.client,
        action.command,
        action.args,
        action.state,
        id=action.id,
        step=action.step,
        error=action.error,
        result=_short(action.result),
    )


def _at_step(event: StepEvent) -> None:
    """The training thread's side: start every due action, in submission order."""
    now = time.time()
    due, missed = [], []
    with _lock:
        for a in list(_pending):
            if a.at_step is not None and event.step is not None and event.step != a.at_step:
                if event.step > a.at_step:  # its step went by unseen (submitted as it passed): never late
                    _pending.remove(a)
                    _miss(a, event.step)
                    missed.append(a)
                continue
            _pending.remove(a)
            if a.timeout is not None and now - a.requested_at >= a.timeout:
                _pending.append(a)  # let expire() report it; it will not run
                continue
            a.state = "running"
            due.append(a)
        if not _pending:
            boundary.remove(_at_step)  # under the lock, so a submit cannot slip in between the test and the removal
    expire()
    for a in missed:
        _audit_end(a)
    for a in due:
        _run(a, Context(step=event.step, frame=event.frame, optimizer=event.optimizer, action_id=a.id))
