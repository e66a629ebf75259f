"""``probe profile-steps``: torch.profiler over the next N steps of a live job, its Chrome trace fetched to a file."""

from __future__ import annotations

from probe._errors import ProbeError

from . import Command, command
from probe.util.printable import printable


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
        from probe.util.files import check_target

        from ..plumbing.actions import POLL, drive
        from ._action import _failure_text

        target = session.target()
        out = os.path.abspath(os.path.expanduser(args.output))
        if not os.path.isdir(os.path.dirname(out)):
            raise ProbeError(
                f"cannot write {printable(args.output)}: its directory does not exist; choose another -o path."
            )
        check_target(out, replace=True)  # before the steps are profiled, not after
        body = {"steps": args.steps, "with_stack": args.with_stack, "record_shapes": args.record_shapes}
        if args.timeout:
            body["timeout"] = args.timeout
        action = drive(session, "profile-steps", target, body)
        if isinstance(action, ProbeError):
            raise action
        if action["state"] != "done":
            raise ActionError(_failure_text(action))
        started = action.get("result") if isinstance(action.get("result"), dict) else {}
        session.note(
            f"probe: profiling steps {started.get('from_step')}-{started.get('until_step')} "
            f"({', '.join(map(str, started.get('activities') or []))})."
        )
        client = session.client(target)
        deadline = time.monotonic() + args.wait
        while True:
            prof = client.get("/profile-steps", timeout=session.timeout)["profile"]
            if prof.get("action_id") != action["id"]:
                raise ActionError(
                    "the process no longer knows this profile (another one replaced it); run profile-steps again."
                )
            if prof.get("state") != "running":
                break
            if time.monotonic() > deadline:
                raise ActionError(
                    f"the {args.steps} steps did not finish within {args.wait:g} s; the trace will be written "
                    f"to {prof.get('path')} on the training host when they do."
                )
            time.sleep(min(POLL / 4, 0.5))  # ok-sleep: polling the profile's state with a deadline
        if prof.get("state") != "done":
            raise ActionError(f"the profile failed: {prof.get('error')}.")
        _fetch(session, client, target, prof, out)
        size = os.path.getsize(out)
        export_s = prof.get("export_s") if type(prof.get("export_s")) in (int, float) else 0.0
        if session.format == "json":
            import json

            session.print(json.dumps({**prof, "output": out}, default=str))
        else:
            session.print(
                f"wrote {printable(out)}: torch.profiler trace of steps "
                f"{prof.get('from_step')}-{prof.get('ended_step')} "
                f"({size / 1e6:.1f} MB, export {export_s:.2f} s); open it at https://ui.perfetto.dev."
            )
        return 0


MAX_TRACE = 2 << 30  # bytes: more than a trace viewer opens; a profile that says it is larger is refused
MIN_CHUNK = 1 << 20  # every chunk but the last carries at least this (the server sends 4 MiB): bounds their count


def _fetch(session, client, target, prof: dict, out: str) -> None:
    """Write the trace to ``out`` from the content of the process's answers, read in chunks.

    Never from a path the answer names: the endpoint may not be the job (a socket or port another
    user holds), and a file it names could be one only this user may read. The chunks must follow
    on from each other and add up to the size the profile declared, which is at most MAX_TRACE.
    """
    import base64
    import binascii

    from probe.util.files import write_file

    size = prof.get("bytes")
    if type(size) is not int or size < 0:
        raise _malformed(target, "a finished profile without its size")
    if size > MAX_TRACE:
        raise ProbeError(
            f"the trace is {size / 1e9:.1f} GB, more than the {MAX_TRACE >> 30} GiB probe copies; profile fewer "
            f"steps, or copy {prof.get('path')} from the training host."
        )

    def copy(f) -> None:
        offset = 0
        while offset is not None:
            chunk = client.get("/profile-steps", timeout=session.timeout + 30, file=prof.get("path"), offset=offset)
            try:
                data = base64.b64decode(chunk["data"], validate=True)
            except (binascii.Error, ValueError):
                raise _malformed(target, "a trace chunk that is not base64") from None
            following = chunk.get("next")
            if following is not None and (type(following) is not int or following != offset + len(data)):
                raise _malformed(target, "a trace chunk that does not follow on from the last")
            if offset + len(data) > size or (following is None and offset + len(data) != size):
                raise _malformed(target, f"a trace longer or shorter than the {size} bytes it declared")
            if following is not None and len(data) < MIN_CHUNK:
                raise _malformed(target, "a trace in chunks too small to be a probe's")
            f.write(data)
            offset = following

    write_file(out, copy, fix="choose another -o path")


def _malformed(target, what: str):
    from probe._errors import EndpointError

    return EndpointError(f"{target.label} did not answer like a probe ({what}); check the endpoint.")
