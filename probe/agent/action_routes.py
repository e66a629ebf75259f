"""HTTP routes of the action and eval tiers, and the wait route the CLI polls.

Every route takes the same scheduling fields in its JSON body:

- ``now`` (bool): run on the server thread at once instead of at the next safe point;
- ``at_step`` (int): run at the safe point of exactly this step, so that several ranks act at
  the same one; an action whose step has passed fails with ``missed_step`` set, never having
  run (the CLI then asks every rank again, later);
- ``timeout`` (seconds): a queued action not started by then is dropped (timed_out);
- ``wait`` (seconds): how long this request waits for the outcome before answering
  with the current state (the CLI then polls ``/actions/wait``).
"""

from __future__ import annotations

from ..config import setting
from .._errors import ActionError, ProbeError
from ..actions import queue
from ..actions.checkpoint import check_target, expand_path, save
from ..actions.evaluate import run_code
from ..actions import guard
from ..actions.lr import LrRequest, change_lr, check_rate, reset_lr
from ..actions.maintenance import (
    PROFILE_MAX_STEPS,
    cleanup,
    current_profile,
    debug,
    read_profile_chunk,
    start_profile,
)
from ..actions.queue import refuse, submit
from ..util import validate as _validate
from .._core import state
from .server import Request, check_tier, route


MAX_WAIT = 30.0


def _number(req: Request, name: str, kind=float, default=None, minimum=None, maximum=None):
    """A finite number (``kind`` float) or a whole number (``kind`` int) within bounds; one sentence otherwise.

    Every number of every action goes through ``probe.util.validate``: NaN and infinities never
    reach an optimizer or a timer.
    """
    value = req.param(name, default)
    try:
        if kind is int:
            return _validate.count(
                value, name, minimum=0 if minimum is None else minimum, maximum=10**12 if maximum is None else maximum
            )
        return _validate.number(value, name, minimum=minimum, maximum=maximum)
    except _validate.BadRequest as exc:
        raise ActionError(exc.message) from None


def _seconds(req: Request, name: str, default=None):
    try:
        return _validate.seconds(req.param(name), name, default=default)
    except _validate.BadRequest as exc:
        raise ActionError(exc.message) from None


def _flag(req: Request, name: str) -> bool:
    return str(req.param(name, "")).lower() in ("1", "true", "yes")


def _schedule(req: Request, default_now: bool = False) -> dict:
    now = _flag(req, "now") if req.param("now") is not None else default_now
    at_step = _number(req, "at_step", int)
    if now and at_step is not None:
        raise ActionError("give either now or at_step, not both.")
    timeout = _seconds(req, "timeout", setting("PROBE_ACTION_TIMEOUT"))
    return {"now": now, "at_step": at_step, "timeout": None if now else timeout}


def _answer(req: Request, action) -> dict:
    wait = min(_number(req, "wait", float, 0.0, minimum=0.0) or 0.0, MAX_WAIT)
    if wait:
        queue.wait(action, wait)
    return {"action": action.to_dict(), "pid": state.info().get("pid"), "rank": state.info().get("rank")}


def _submit(req: Request, command: str, args: dict, fn, default_now: bool = False) -> dict:
    try:
        sched = _schedule(req, default_now)
    except ProbeError as exc:
        refuse(req.client, command, args, exc.message)
    action = submit(command, fn, args=args, client=req.client, **sched)
    return _answer(req, action)


@route("POST", "/actions/eval", tier="eval")
def eval_route(req: Request) -> dict:
    code = req.param("code")
    args = {"code": code if isinstance(code, str) else repr(code)}
    if not isinstance(code, str) or not code.strip():
        refuse(req.client, "eval", args, "no code given; pass the code as an argument or with -f FILE.")
    # Immediate unless a safe point is asked for (reading state is the common case).
    return _submit(req, "eval", args, lambda ctx: run_code(code, ctx), default_now=req.param("at_step") is None)


@route("POST", "/actions/checkpoint", tier="action")
def checkpoint_route(req: Request) -> dict:
    path, force = req.param("path"), _flag(req, "force")
    args = {"path": path if isinstance(path, str) else repr(path), "force": force}
    if not isinstance(path, str) or not path.strip():
        refuse(
            req.client, "checkpoint", args, "no path given; pass the checkpoint file, e.g. /ckpt/emergency-{rank}.pt."
        )
    try:  # text every file function takes (a lone surrogate broke os.lstat: 500 and no audit line)
        _validate.file_path(path, "the checkpoint path")
    except _validate.BadRequest as exc:
        refuse(req.client, "checkpoint", args, exc.message)
    rank = state.info().get("rank")
    expanded = expand_path(path, rank, queue.last_step())
    try:
        if "{step}" not in path:
            check_target(expanded, force)
    except ProbeError as exc:
        refuse(req.client, "checkpoint", {**args, "expanded": expanded}, exc.message)
    return _submit(
        req,
        "checkpoint",
        {**args, "expanded": expanded},
        lambda ctx: save(ctx, expand_path(path, rank, ctx.step), force),
    )


def _optimizer(req: Request):
    """``optimizer``: an index in torch.optimizer's order (a whole number) or the name shown there."""
    value = req.param("optimizer")
    if isinstance(value, str) and not value.strip().isdigit():
        if not value or len(value) > 200:
            raise ActionError("optimizer: give the name torch.optimizer shows, or its index.")
        return value
    return _number(req, "optimizer", int)


@route("POST", "/actions/lr", tier="action")
def lr_route(req: Request) -> dict:
    args = {
        k: req.param(k)
        for k in ("set", "scale", "group", "optimizer", "once", "reset", "force", "allow_zero")
        if req.param(k) is not None
    }
    try:
        # finite and not negative (NaN or inf would ruin the run for good): checked here, before any queueing
        lr = LrRequest(
            set_to=_number(req, "set", minimum=0.0),
            scale=_number(req, "scale", minimum=0.0),
            group=_number(req, "group", int),
            optimizer=_optimizer(req),
            once=_flag(req, "once"),
            force=_flag(req, "force"),
            allow_zero=_flag(req, "allow_zero"),
            reset=_flag(req, "reset"),
        )
        if lr.reset:
            if lr.set_to is not None or lr.scale is not None:
                raise ActionError("--reset removes the override; give it without --set or --scale.")
            return _submit(req, "lr", args, lambda ctx: reset_lr(ctx, lr))
        if (lr.set_to is None) == (lr.scale is None):
            raise ActionError("give exactly one of --set LR, --scale FACTOR or --reset.")
        check_rate(lr)  # what the parameters' dtype can take, 0, and a jump past 10x: refused here, nothing queued
    except ProbeError as exc:
        refuse(req.client, "lr", args, exc.message)
    return _submit(req, "lr", args, lambda ctx: change_lr(ctx, lr))


@route("POST", "/actions/cleanup", tier="action")
def cleanup_route(req: Request) -> dict:
    zero = _flag(req, "zero_grad")
    return _submit(req, "cleanup", {"zero_grad": zero}, lambda ctx: cleanup(ctx, zero))


@route("POST", "/actions/guard", tier="action")
def guard_route(req: Request) -> dict:
    """Arm the guard (``on``, ``keep``, ``skip``, ``rollback``, ``evidence``) or take it out (``off``), at the next
    step boundary; what it will hold in memory is checked before anything is queued."""
    fields = ("on", "keep", "skip", "rollback", "evidence", "off")
    args = {k: req.param(k) for k in fields if req.param(k) is not None}
    try:
        if _flag(req, "now"):
            raise ActionError("the guard is armed and taken out at a step boundary; --now does not apply.")
        if _flag(req, "off"):
            if set(args) - {"off"}:
                raise ActionError("--off takes the guard out; give it alone.")
            return _submit(req, "guard", args, lambda ctx: guard.disarm(ctx.step))
        on, evidence = req.param("on"), req.param("evidence")
        if on is not None and not isinstance(on, str) or evidence is not None and not isinstance(evidence, str):
            raise ActionError("on and evidence are text: the triggers, and a directory.")
        if evidence is not None:
            _validate.file_path(evidence, "the evidence directory")
        spec = guard.parse_spec(
            on, _number(req, "keep", int, 1, maximum=64), _flag(req, "skip"), _flag(req, "rollback"), evidence
        )
        guard.estimate(spec)  # the memory it would hold, and whether ranks could disagree: refused here
    except ProbeError as exc:  # validate's BadRequest included
        refuse(req.client, "guard", args, exc.message)
    return _submit(req, "guard", args, lambda ctx: guard.arm(spec, ctx.step))


@route("GET", "/guard")
def guard_state_route(req: Request) -> dict:
    return {"guard": guard.state()}


@route("POST", "/actions/profile-steps", tier="action")
def profile_steps_route(req: Request) -> dict:
    args = {k: req.param(k) for k in ("steps", "with_stack", "record_shapes") if req.param(k) is not None}
    try:
        steps = _number(req, "steps", int)
        if steps is None or not 1 <= steps <= PROFILE_MAX_STEPS:
            raise ActionError(f"steps must be a whole number from 1 to {PROFILE_MAX_STEPS}.")
        if _flag(req, "now"):
            raise ActionError("profile-steps starts at a step boundary; --now does not apply.")
    except ProbeError as exc:
        refuse(req.client, "profile-steps", args, exc.message)
    running = current_profile()
    if running.get("state") == "running":
        refuse(
            req.client,
            "profile-steps",
            args,
            f"a profile is already running in this process (steps "
            f"{running['from_step']}-{running['until_step']}); wait for it to finish.",
        )
    stack, shapes = _flag(req, "with_stack"), _flag(req, "record_shapes")
    return _submit(req, "profile-steps", args, lambda ctx: start_profile(ctx, steps, stack, shapes))


@route("GET", "/profile-steps")
def profile_steps_state_route(req: Request) -> dict:
    offset = _number(req, "offset", int)
    if offset is not None:
        return read_profile_chunk(str(req.param("file")), offset)
    return {"profile": current_profile()}


@route("POST", "/actions/debug", tier="eval")  # debugpy has no authentication: it is code execution
def debug_route(req: Request) -> dict:
    args = {"port": req.param("port", 5678)}
    try:
        port = _number(req, "port", int, 5678, maximum=65535)
    except ProbeError as exc:
        refuse(req.client, "debug", args, exc.message)
    # debugpy.listen does not touch training state: it runs at once unless a safe point is asked for.
    return _submit(req, "debug", args, lambda ctx: debug(ctx, port), default_now=req.param("at_step") is None)


@route("POST", "/actions/cancel", tier="action")
def cancel_route(req: Request) -> dict:
    """Cancel a queued action or interrupt a running ``now`` one (an eval needs the eval tier to cancel too)."""
    action_id = _number(req, "id", int, minimum=1)
    if action_id is None:
        raise ActionError("pass the id of the action to cancel (`SELECT id, command, state FROM probe.actions`).")
    action = queue.get(action_id)
    if action.command in ("eval", "debug"):
        check_tier(req.client, "eval")
    queue.cancel(action_id, req.client)
    return _answer(req, action)


@route("GET", "/actions/wait")
def wait_route(req: Request) -> dict:
    action_id = _number(req, "id", int, minimum=1)
    if action_id is None:
        raise ActionError("pass the action id to wait for.")
    return _answer(req, queue.get(action_id))


def _status() -> dict:
    pending = sum(1 for a in queue.actions() if a.state in ("queued", "running"))
    return {"safepoint_step": queue.last_step(), "actions_pending": pending}


state.add_status_provider(_status)
