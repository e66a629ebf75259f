"""``probe profile-steps``: torch.profiler over the next N steps of a live job, its Chrome trace fetched to a file."""

from __future__ import annotations

from probe._errors import ProbeError

from . import Command, command


@command(
    "profile-steps",
    "Run torch.profiler over the next N steps of a live job and write its Chrome trace (CPU, and CUDA where used) to "
    "a file.",
)
class ProfileSteps(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("steps", type=int, help="How many steps to profile (1-100), starting at the next step boundary.")
        p.add_argument(
            "-o",
            "--output",
            required=True,
            help="File to write the Chrome trace to (open it in Perfetto or chrome://tracing).",
        )
        p.add_argument(
            "--with-stack", action="store_true", help="Record Python stacks of operators (more overhead, larger trace)."
        )
        p.add_argument("--record-shapes", action="store_true", help="Record input shapes of operators.")
        p.add_argument(
            "--wait", type=float, default=600.0, help="Seconds to wait for the N steps to finish (default 600)."
        )

    def run(self, session, args):
        import os
        import time

        from probe._errors import ActionError

        from ..plumbing.actions import POLL, drive
        from ._action import _failure_text

        target = session.target()
        out = os.path.abspath(os.path.expanduser(args.output))
        if not os.path.isdir(os.path.dirname(out)):
            raise ProbeError(f"cannot write {args.output}: its directory does not exist; choose another -o path.")
        body = {"steps": args.steps, "with_stack": args.with_stack, "record_shapes": args.record_shapes}
        if args.timeout:
            body["timeout"] = args.timeout
        action = drive(session, "profile-steps", target, body)
        if isinstance(action, ProbeError):
            raise action
        if action["state"] != "done":
            raise ActionError(_failure_text(action))
        started = action["result"]
        session.note(
            f"probe: profiling steps {started['from_step']}-{started['until_step']} "
            f"({', '.join(started['activities'])})."
        )
        client = session.client(target)
        deadline = time.monotonic() + args.wait
        while True:
            prof = client.get("/profile-steps", timeout=session.timeout)["profile"]
            if prof.get("action_id") != action["id"]:
                raise ActionError(
                    "the process no longer knows this profile (another one replaced it); run profile-steps again."
                )
            if prof["state"] != "running":
                break
            if time.monotonic() > deadline:
                raise ActionError(
                    f"the {args.steps} steps did not finish within {args.wait:g} s; the trace will be written "
                    f"to {prof['path']} on the training host when they do."
                )
            time.sleep(min(POLL / 4, 0.5))  # ok-sleep: polling the profile's state with a deadline
        if prof["state"] != "done":
            raise ActionError(f"the profile failed: {prof.get('error')}.")
        _fetch(session, client, target, prof["path"], out)
        size = os.path.getsize(out)
        if session.format == "json":
            import json

            session.print(json.dumps({**prof, "output": out}, default=str))
        else:
            session.print(
                f"wrote {out}: torch.profiler trace of steps {prof['from_step']}-{prof['ended_step']} "
                f"({size / 1e6:.1f} MB, export {prof.get('export_s', 0):.2f} s); open it at https://ui.perfetto.dev."
            )
        return 0


def _fetch(session, client, target, remote: str, out: str) -> None:
    """Copy the trace: from the runtime directory on this host, else in chunks over the connection."""
    import base64
    import os
    import shutil

    tmp = out + ".tmp"
    try:
        if target.socket and os.path.exists(remote):
            shutil.copyfile(remote, tmp)
        else:
            offset = 0
            with open(tmp, "wb") as f:
                while offset is not None:
                    chunk = client.get("/profile-steps", timeout=session.timeout + 30, file=remote, offset=offset)
                    f.write(base64.b64decode(chunk["data"]))
                    offset = chunk["next"]
        os.replace(tmp, out)
    except OSError as exc:
        raise ProbeError(f"cannot write {out} ({exc.strerror}); choose another -o path.") from None
