"""The guarded action commands: ``eval``, ``checkpoint``, ``cleanup``, ``debug`` and ``cancel``, and the flow
they share with ``lr`` (``_Action``).

Each command builds one request body per target; with several targets (``--ranks``) it asks
for confirmation unless ``--yes``. ``cli.plumbing.actions`` sends the requests (every rank at
one common step) and waits for the outcomes, which the command then renders. The commands are
small and of one shape (arguments, a body, a rendering), so they share this module: the flow
and every use of it read in one place. ``lr``, whose request and rendering are larger, has its own.
"""

from __future__ import annotations

import json
import os
import sys

from probe._errors import ActionError, PartialError, ProbeError

from ..plumbing.actions import cancel, drive, drive_many
from . import Command, command


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


@command(
    "eval", "Run Python code in the training process (the eval tier); prints its output, final value or traceback."
)
class Eval(_Action):
    @staticmethod
    def add_arguments(p):
        p.add_argument("code", nargs="?", help="Python code (several lines allowed); - reads standard input.")
        p.add_argument("-f", "--file", dest="file", help="Read the code from this file.")
        p.add_argument(
            "--at-step",
            action="store_true",
            dest="at_step",
            help="Run at the next step boundary, with the training loop's locals (loss, batch, ...).",
        )

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
        session.print(
            f"{prefix}wrote {r['path']}{step}: {_bytes(r['bytes'])} in {r['seconds']:.2f} s, "
            f"sha256 {r['sha256'][:16]}... ({', '.join(r['contents'])})."
        )
        if r.get("sharded"):
            rank = r.get("rank") if r.get("rank") is not None else 0
            session.print(
                f"{prefix}the model is sharded ({r['sharded']}, FSDP2/DTensor): the file holds rank {rank}'s "
                f"shards of {r.get('world_size') or '?'}; load it on rank {rank} of a job sharded the same way, "
                f"after fully_shard: probe.load_checkpoint(path, model=model, optimizer=optimizer) "
                f"(plain torch.load needs `import torch.distributed.tensor` first)."
            )


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
        p.add_argument(
            "--port", type=int, default=5678, help="Port on the training host's loopback (default 5678; 0 picks one)."
        )

    def queued(self, args) -> bool:
        return False

    def body(self, session, args, target):
        return {"port": args.port}

    def check_many(self, session, args, targets):
        hosts = [t.entry.get("host") for t in targets]
        if args.port and len(set(hosts)) < len(hosts):
            raise ProbeError(
                "several processes on one host cannot share one debug port; pass --port 0 to let each pick its own."
            )

    def render(self, session, target, action, prefix):
        r = action.get("result") or {}
        if action["state"] != "done":
            return
        state = "already listening" if r.get("already") else "listening"
        session.print(f"{prefix}debugpy {state} on {r['host']}:{r['port']} in pid {r['pid']}.")
        session.print(
            f"{prefix}Exposure: debugpy has no authentication; until pid {r['pid']} exits, any local user who "
            f"can reach {r['host']}:{r['port']} can run code as this process's user (the eval tier)."
        )
        if not _local(target):
            session.print(
                f"{prefix}It listens on the training host's loopback: tunnel first, "
                f"e.g. ssh -L {r['port']}:127.0.0.1:{r['port']} {target.host}."
            )
        session.print(f'{prefix}VS Code launch configuration (add to .vscode/launch.json "configurations"):')
        for line in json.dumps(r.get("vscode"), indent=2).splitlines():
            session.print(prefix + line)


@command("cancel", "Cancel an action by id: a queued one is dropped, a running --now eval is interrupted.")
class Cancel(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("id", type=int, help="The action id (printed when it was sent; also in probe.actions).")

    def run(self, session, args):
        action = cancel(session, None, {"id": args.id})  # None: the one target of the command line
        if session.format == "json":
            session.print(json.dumps(action, indent=2, default=str))
        else:
            state = action["state"]
            session.print(
                f"action {action['id']} ({action['command']}) is {state}"
                + (": it stops at its next Python instruction." if state == "running" else ".")
            )
        return 0
