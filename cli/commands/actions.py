"""Guarded actions: eval, checkpoint, lr, cleanup, debug.

Each command sends one request per target, then waits for the action's outcome
(progress on stderr while it is queued). With several targets (``--ranks``) it asks
for confirmation unless ``--yes``, and asks every rank to act at the same step: the
largest current step across ranks plus a small margin.
"""

from __future__ import annotations

import json
import os
import sys
import time

from probe._errors import ActionError, PartialError, ProbeError

from . import Command, command

STEP_MARGIN = 2
POLL = 2.0

_NOW_RISK = {
    "checkpoint": "--now writes the checkpoint from the server thread while training may be mid-step: weights and optimizer state can come from different sides of an update.",
    "lr": "--now changes the learning rate from the server thread: an optimizer step running right now may use the old rate for some parameters and the new one for others.",
    "cleanup": "--now runs gc and empty_cache from the server thread while training runs; --zero-grad may drop gradients a step is about to use.",
    "eval": "--now runs the code on the server thread while training runs: reading is fine, but changing state can race with the step in progress.",
    "debug": "",
}


class _Action(Command):
    """Shared flow: build the body, confirm, submit to every target, wait, render."""

    queued_by_default = True

    @staticmethod
    def add_common(p, now_help: str = "Run at once on the probe's server thread instead of at the next step boundary (for a hung process).") -> None:
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
            _confirm(session, args, f"`{self.describe(args)}` to {len(targets)} processes ({_labels(targets)})"
                     + (f" at step {at_step}" if at_step is not None else ""))
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
                outcomes = list(pool.map(lambda tb: _drive(session, self.name, tb[0], tb[1], single),
                                         zip(targets, bodies)))
            except KeyboardInterrupt:
                raise ProbeError("interrupted; the actions go on in the training processes (see probe.actions; "
                                 "`probe --rank N cancel ID` cancels one).", exit_code=130) from None
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
        if session.format == "json":
            session.print(json.dumps([{"target": t.label, "rank": t.rank, "pid": t.pid,
                                       **({"action": o} if isinstance(o, dict) else {"error": o.message})}
                                      for t, o in zip(targets, outcomes)], indent=2, default=str))
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

    from .._fanout import parallel

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
            raise ProbeError("interrupted before the process confirmed the action; see probe.actions.", exit_code=130) from None
        try:  # Ctrl-C cancels what we started: a queued action is dropped, a running --now eval interrupted
            done = client.post("/actions/cancel", {"id": action["id"], "wait": 2.0}, timeout=5.0 + session.timeout)["action"]
        except ProbeError as exc:
            raise ProbeError(f"interrupted; action {action['id']} could not be cancelled ({exc.message.rstrip('.')}) "
                             "and goes on in the training process (see probe.actions).", exit_code=130) from None
        raise ProbeError(f"interrupted; action {action['id']} is {done['state']}"
                         + (" (it stops at its next Python instruction)." if done["state"] == "running" else "."),
                         exit_code=130) from None
    except ProbeError as exc:
        return exc


def _progress(session, action: dict, waited: float) -> None:
    if action["state"] == "queued":
        where = f"step {action['at_step']}" if action.get("at_step") is not None else "the next step boundary"
        last = action.get("last_step")
        session.note(f"probe: action {action['id']} queued {waited:.0f} s, waiting for {where}"
                     + (f" (last step {last})" if last is not None else " (no step seen yet)")
                     + (f"; it is dropped after {action['timeout']:g} s" if action.get("timeout") else "") + ".")
    else:
        session.note(f"probe: action {action['id']} running for {time.time() - (action.get('started_at') or time.time()):.0f} s.")


def _local(target) -> bool:
    return bool(target.socket)


@command("cancel", "Cancel an action by id: a queued one is dropped, a running --now eval is interrupted.")
class Cancel(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("id", type=int, help="The action id (printed when it was sent; also in probe.actions).")

    def run(self, session, args):
        doc = session.client().post("/actions/cancel", {"id": args.id, "wait": 2.0}, timeout=5.0 + session.timeout)
        action = doc["action"]
        if session.format == "json":
            session.print(json.dumps(action, indent=2, default=str))
        else:
            state = action["state"]
            session.print(f"action {action['id']} ({action['command']}) is {state}"
                          + (": it stops at its next Python instruction." if state == "running" else "."))
        return 0


@command("eval", "Run Python code in the training process (the eval tier); prints its output, final value or traceback.")
class Eval(_Action):
    @staticmethod
    def add_arguments(p):
        p.add_argument("code", nargs="?", help="Python code (several lines allowed); - reads standard input.")
        p.add_argument("-f", "--file", dest="file", help="Read the code from this file.")
        p.add_argument("--at-step", action="store_true", dest="at_step",
                       help="Run at the next step boundary, with the training loop's locals (loss, batch, ...).")

    def queued(self, args) -> bool:
        return args.at_step

    def body(self, session, args, target) -> dict:
        return {"code": self._code, **({"now": False} if args.at_step else {})}

    def run(self, session, args):
        if args.code and args.file:
            raise ProbeError("give the code either as an argument or with -f FILE, not both.")
        if args.file:
            try:
                with open(args.file) as f:
                    self._code = f.read()
            except OSError as exc:
                raise ProbeError(f"cannot read {args.file} ({exc.strerror}); check the path.") from None
        elif args.code == "-":
            self._code = sys.stdin.read()
        elif args.code:
            self._code = args.code
        else:
            raise ProbeError("no code given; pass it as an argument, with -f FILE, or - for standard input.")
        return super().run(session, args)

    def describe(self, args) -> str:
        return "eval"

    def render(self, session, target, action, prefix):
        res = action.get("result") or {}
        for line in (res.get("stdout") or "").splitlines():
            session.print(prefix + line)
        for line in (res.get("stderr") or "").splitlines():
            session.note(prefix + line)
        if res.get("value") is not None:
            for line in res["value"].splitlines():
                session.print(prefix + line)
        if res.get("traceback"):
            for line in res["traceback"].rstrip().splitlines():
                session.note(prefix + line)


@command("checkpoint", "Save model, optimizer, scheduler, step and RNG states at the next step boundary, atomically.")
class Checkpoint(_Action):
    @staticmethod
    def add_arguments(p):
        p.add_argument("path", help="File to write; {rank}, {pid} and {step} are expanded in the training process.")
        p.add_argument("--force", action="store_true", help="Overwrite an existing file.")
        _Action.add_common(p)

    def body(self, session, args, target):
        path = args.path
        if _local(target) and not os.path.isabs(os.path.expanduser(path)):
            path = os.path.abspath(path)  # relative to where the user runs probe, for a local process
        return {"path": path, "force": args.force, "now": args.now}

    def check_many(self, session, args, targets):
        if "{rank}" not in args.path and "{pid}" not in args.path:
            raise ProbeError("several processes would write the same file; put {rank} in PATH, e.g. ckpt-{rank}.pt.")

    def describe(self, args):
        return f"checkpoint {args.path}"

    def render(self, session, target, action, prefix):
        r = action.get("result") or {}
        if action["state"] != "done":
            return
        step = "" if r.get("step") is None else f" at step {r['step']}"
        session.print(f"{prefix}wrote {r['path']}{step}: {_bytes(r['bytes'])} in {r['seconds']:.2f} s, "
                      f"sha256 {r['sha256'][:16]}... ({', '.join(r['contents'])}).")
        if r.get("sharded"):
            rank = r.get("rank") if r.get("rank") is not None else 0
            session.print(f"{prefix}the model is sharded ({r['sharded']}, FSDP2/DTensor): the file holds rank {rank}'s "
                          f"shards of {r.get('world_size') or '?'}; load it on rank {rank} of a job sharded the same way, "
                          f"after fully_shard: probe.load_checkpoint(path, model=model, optimizer=optimizer) "
                          f"(plain torch.load needs `import torch.distributed.tensor` first).")


@command("lr", "Change the learning rate from the next optimizer step on, held against the loop's scheduler or "
                "hand-written schedule, and checked at that step.")
class Lr(_Action):
    @staticmethod
    def add_arguments(p):
        g = p.add_mutually_exclusive_group(required=True)
        g.add_argument("--set", type=float, metavar="LR", help="Every step uses this learning rate.")
        g.add_argument("--scale", type=float, metavar="F", help="Every step uses the loop's own learning rate times F.")
        g.add_argument("--reset", action="store_true", help="Remove the override: the loop's own rate applies again.")
        p.add_argument("--group", type=int, metavar="N", help="Only param group N (default: every group).")
        p.add_argument("--optimizer", metavar="NAME", help="Only this optimizer, when there are several: its name in "
                       "torch.optimizer (opt_d, trainer.optimizer) or its index there (0, 1, ...).")
        p.add_argument("--once", "--ignore-scheduler", dest="once", action="store_true",
                       help="Write param_groups once without holding it (the next step is still checked: it fails "
                            "if the loop rewrote the rate first).")
        p.add_argument("--force", action="store_true",
                       help="Allow a rate more than 10x the largest one in use now (never one the parameters' dtype "
                            "cannot take).")
        p.add_argument("--allow-zero", action="store_true", help="Allow a rate of 0 (the weights stop changing).")
        _Action.add_common(p)

    def body(self, session, args, target):
        b = {"now": args.now, "once": args.once, "reset": args.reset, "force": args.force, "allow_zero": args.allow_zero}
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
            session.print(f"{prefix}optimizer '{g['optimizer']}' group {g['group']}: removed {g['override']}{after}; "
                          f"the loop's lr {g['loop_lr']:.6g} applies from {when}.")
        for opt in r.get("optimizers", []):
            via = f" (through {opt['wrapper']})" if opt.get("wrapper") else ""
            held = ("written once" if r.get("mode") == "once" else
                    "through its scheduler's base rates (param_groups and the loop's logs show the new rate)"
                    if opt.get("via") == "scheduler" else
                    "held at every step (a loop that writes its own rate: its logs and param_groups show the loop's "
                    "value, torch.steps.lr what each step used)")
            session.print(f"{prefix}optimizer '{opt['optimizer']}' {opt.get('type', '')}{via}, {held}"
                          + ("" if r.get("step") is None else f", from step {r['step'] + 1}") + ":")
            for g in opt["groups"]:
                used = g.get("used")
                check = (f"; step {r['checked_at_step']} used {used:.6g}" if used is not None and r.get("checked_at_step")
                         else "; not yet seen used")
                session.print(f"{prefix}  group {g['group']}: {g['before']:.6g} -> {g['after']:.6g}{check}"
                              + (f" ({g['note']})" if g.get("note") else ""))


@command("cleanup", "Run gc and empty the CUDA cache at the next step boundary; report memory before and after.")
class Cleanup(_Action):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--zero-grad", action="store_true", help="Also free gradients (zero_grad(set_to_none=True)).")
        _Action.add_common(p)

    def body(self, session, args, target):
        return {"zero_grad": args.zero_grad, "now": args.now}

    def describe(self, args):
        return "cleanup" + (" --zero-grad" if args.zero_grad else "")

    def render(self, session, target, action, prefix):
        r = action.get("result") or {}
        if action["state"] != "done":
            return
        b, a = r.get("before", {}), r.get("after", {})
        parts = [f"{k} {_bytes(b.get(k))} -> {_bytes(a.get(k))}" for k in a if b.get(k) is not None]
        extra = f", gradients freed {_bytes(r['grad_bytes_freed'])}" if "grad_bytes_freed" in r else ""
        session.print(f"{prefix}gc collected {r.get('gc_collected')} objects; " + "; ".join(parts) + extra + ".")


@command("debug", "Start debugpy in the training process, listening on loopback, and print how to attach.")
class Debug(_Action):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--port", type=int, default=5678, help="Port on the training host's loopback (default 5678; 0 picks one).")

    def queued(self, args) -> bool:
        return False

    def body(self, session, args, target):
        return {"port": args.port}

    def check_many(self, session, args, targets):
        hosts = [t.entry.get("host") for t in targets]
        if args.port and len(set(hosts)) < len(hosts):
            raise ProbeError("several processes on one host cannot share one debug port; pass --port 0 to let each pick its own.")

    def render(self, session, target, action, prefix):
        r = action.get("result") or {}
        if action["state"] != "done":
            return
        state = "already listening" if r.get("already") else "listening"
        session.print(f"{prefix}debugpy {state} on {r['host']}:{r['port']} in pid {r['pid']}.")
        session.print(f"{prefix}Exposure: debugpy has no authentication; until pid {r['pid']} exits, any local user who "
                      f"can reach {r['host']}:{r['port']} can run code as this process's user (the eval tier).")
        if not _local(target):
            session.print(f"{prefix}It listens on the training host's loopback: tunnel first, "
                          f"e.g. ssh -L {r['port']}:127.0.0.1:{r['port']} {target.host}.")
        session.print(f"{prefix}VS Code launch configuration (add to .vscode/launch.json \"configurations\"):")
        for line in json.dumps(r.get("vscode"), indent=2).splitlines():
            session.print(prefix + line)


def _bytes(n) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
