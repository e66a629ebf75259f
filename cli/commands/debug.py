"""``probe debug``: start debugpy in the training process, on loopback, and print how to attach."""

from __future__ import annotations

import json

from probe._errors import ProbeError

from . import command
from ._action import _Action, _local


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
