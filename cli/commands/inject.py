"""``probe inject PID``: start the probe server inside a running Python process."""

from __future__ import annotations

import json

from probe._errors import ProbeError

from . import Command, command


@command("inject", "Start the probe server inside a running Python process that never imported probe.")
class Inject(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument(
            "pid", nargs="?", type=int, help="Process id of the Python process (e.g. from ps or nvidia-smi)."
        )
        p.add_argument(
            "--via",
            choices=("remote_exec", "gdb"),
            action="append",
            help="Use only this method (repeatable); default: PROBE_INJECT_VIA (remote_exec, then gdb).",
        )
        p.add_argument(
            "--hang-timeout",
            type=float,
            metavar="S",
            help="Also arm the hang watchdog in the target (PROBE_HANG_TIMEOUT there).",
        )
        p.add_argument(
            "--wait",
            type=float,
            metavar="S",
            default=10.0,
            help="Seconds to wait for the target to run the bootstrap (default 10).",
        )

    def run(self, session, args):
        pid = args.pid
        if pid is None and getattr(args, "endpoint", None) and str(args.endpoint).isdigit():
            pid = int(args.endpoint)
        if pid is None:
            raise ProbeError("`probe inject` needs the pid of a Python process: `probe inject PID`.")
        from probe.injector import inject

        env = {}
        if args.hang_timeout is not None:
            if args.hang_timeout <= 0:
                raise ProbeError("--hang-timeout takes a positive number of seconds, e.g. --hang-timeout 300.")
            env["PROBE_HANG_TIMEOUT"] = f"{args.hang_timeout:g}"
        out = inject(pid, via=args.via, env=env, timeout=args.wait)
        entry = out["entry"]
        if session.format == "json":
            session.print(json.dumps(out, indent=2, default=str))
            return 0
        if out["already_running"]:
            where = entry.get("socket")
            session.print(f"process {pid} already runs a probe ({where}); nothing to do.")
        else:
            session.print(
                f"probe started in process {pid} via {out['via']} in {out['elapsed']:.2f} s "
                f"(socket {entry.get('socket')})."
            )
        session.print(f'Try: probe {pid} query "SELECT name, state, func, lineno FROM python.threads"')
        return 0
