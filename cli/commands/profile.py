"""The commands that record what the job does over time: ``profile`` (sample every thread's stack for N seconds;
write a flamegraph's data), ``profile-steps`` (torch.profiler over the next N steps of a live job, its Chrome
trace fetched to a file) and ``trace`` (a timeline of the last steps as Chrome trace-event JSON, for Perfetto or
chrome://tracing). They share this module: each asks for a recording and writes it to a file.
"""

from __future__ import annotations

import os
import time

from probe._errors import ProbeError
from probe.util.printable import printable

from . import Command, command


MAX_SECONDS = 60.0  # the agent's own bound (probe.agent.routes.MAX_SECONDS); the CLI does not import the agent


def fetch_profile(session, target, seconds: float, native: bool = False, hz: float = 100.0) -> dict:
    """Collapsed stacks of one process: ``{"stacks": [[stack, count], ...], "samples", "seconds", "source"}``.

    Through the probe server (``GET /profile``), or with ``native`` through ``py-spy record``
    (native frames; the process must be on this host).
    """
    if not 0 < seconds <= MAX_SECONDS:
        raise ProbeError(f"--seconds must be above 0 and at most {MAX_SECONDS:g}, got {seconds:g}.")
    if not native:
        # the server may wait half the timeout for its share (PROBE_SERVE_SHARE), so a refusal comes before the timeout
        wait = f"{session.timeout / 2:g}"
        return session.client(target).get(
            "/profile", timeout=seconds + session.timeout, seconds=seconds, hz=hz, wait=wait
        )
    pid = target.local_pid
    if pid is None:
        raise ProbeError(
            "--native samples the process with py-spy, which works only on its host; run the command on the process's "
            "node."
        )
    from probe.injector import pyspy_record

    started = time.perf_counter()
    stacks = pyspy_record(pid, seconds, hz=hz, native=True)
    return {
        "source": "py-spy",
        "pid": pid,
        "rank": target.rank,
        "stacks": stacks,
        "samples": None,
        "seconds": round(time.perf_counter() - started, 3),
        "hz": hz,
    }


def merge(docs: list, by_rank: bool) -> list:
    """Stacks of several processes in one list; with ``by_rank`` each stack starts at its rank."""
    merged: dict[str, int] = {}
    for label, doc in docs:
        for stack, n in doc.get("stacks") or []:
            key = f"{label};{stack}" if by_rank else stack
            merged[key] = merged.get(key, 0) + n
    return sorted(([k, v] for k, v in merged.items()), key=lambda kv: -kv[1])


@command(
    "profile",
    "Sample every thread's stack for N seconds (py-spy with --native); write collapsed stacks, speedscope JSON or an "
    "SVG flamegraph.",
    own_format=True,
)
class Profile(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--seconds", type=float, default=5.0, help="How long to sample (default 5, at most 60).")
        p.add_argument("--hz", type=float, default=100.0, help="Samples per second (default 100, at most 250).")
        p.add_argument(
            "--native",
            action="store_true",
            help="Include native (C/C++) frames: sample with py-spy record (local processes).",
        )
        p.add_argument("-o", "--output", metavar="FILE", help="Write here instead of standard output.")
        p.add_argument(
            "--format",
            dest="format",
            choices=("collapsed", "speedscope", "svg"),
            default=None,
            help="collapsed (default; flamegraph.pl, inferno), speedscope (JSON for speedscope.app) or svg; "
            "by default taken from -o's extension (.svg, .json).",
        )

    def run(self, session, args):
        from ..plumbing.fanout import check_partial, fan_out
        from probe.util.files import check_target, write_file

        from ..stacks import to_collapsed, to_speedscope, to_svg

        if not 0 < args.seconds <= MAX_SECONDS:
            raise ProbeError(f"--seconds must be above 0 and at most {MAX_SECONDS:g}, got {args.seconds:g}.")
        if not 0 < args.hz <= 250:
            raise ProbeError(f"--hz must be above 0 and at most 250, got {args.hz:g}.")
        fmt = args.format
        if fmt is None:
            ext = os.path.splitext(args.output or "")[1].lower()
            fmt = {".svg": "svg", ".json": "speedscope"}.get(ext, "collapsed")
        if args.output:
            check_target(os.path.expanduser(args.output), replace=True)  # before sampling, not after
        targets = session.targets()
        answers = fan_out(targets, lambda t: fetch_profile(session, t, args.seconds, args.native, args.hz))
        docs = [(a.target.label, a.value) for a in answers if a.ok]
        if not docs:
            check_partial(answers, "profile")
        stacks = merge(docs, by_rank=len(targets) > 1)
        where = ", ".join(label for label, _ in docs)
        title = f"probe profile: {where}, {args.seconds:g} s" + (" (native, py-spy)" if args.native else "")
        text = {
            "collapsed": to_collapsed,
            "speedscope": lambda s: to_speedscope(s, title),
            "svg": lambda s: to_svg(s, title),
        }[fmt](stacks)
        if args.output:
            write_file(os.path.expanduser(args.output), lambda f: f.write(text.encode()), fix="choose another -o path")
            total = sum(n for _, n in stacks)
            session.note(
                f"probe: wrote {fmt} of {total} samples ({len(stacks)} distinct stacks) from {where} to "
                f"{printable(args.output)}."
            )
        else:
            session.stdout.write(text)
            session.stdout.flush()
        check_partial(answers, "profile")
        return 0


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
        from .actions import _failure_text

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


@command(
    "trace",
    "Write a timeline of the last steps (steps, sampled module calls, user spans, collectives) as Chrome trace-event "
    "JSON for Perfetto or chrome://tracing.",
)
class Trace(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--steps", type=int, default=10, help="How many of the latest steps to include (default 10).")
        p.add_argument(
            "-o", "--output", required=True, help="File to write the trace to; - writes it to standard output."
        )

    def run(self, session, args):
        import json
        import os
        import time

        from probe.util.files import check_target, write_file

        from ..plumbing.fanout import check_partial, fan_out
        from ..timeline import build_trace, rank_rows

        if args.steps < 1:
            raise ProbeError("--steps must be at least 1.")
        if args.output != "-":
            check_target(os.path.expanduser(args.output), replace=True)  # before the queries, not after
        started = time.perf_counter()
        answers = fan_out(session.targets(), lambda t: rank_rows(session, t, args.steps))
        ok = [a.value for a in answers if a.ok]
        if not ok:
            check_partial(answers, "timeline queries")
        doc = build_trace([rr for rr, _ in ok], {"steps": args.steps})
        text = json.dumps(doc, separators=(",", ":"), default=str)
        if args.output == "-":
            session.print(text)
        else:
            path = os.path.abspath(os.path.expanduser(args.output))
            write_file(path, lambda f: f.write(text.encode()), fix="choose another -o path")
            n = sum(1 for e in doc["traceEvents"] if e["ph"] != "M")
            summary = {
                "path": path,
                "ranks": len(ok),
                "events": n,
                "bytes": len(text),
                "seconds": round(time.perf_counter() - started, 3),
            }
            if session.format == "json":
                session.print(json.dumps(summary))
            else:
                session.print(
                    f"wrote {printable(path)}: {n} events from {len(ok)} process{'es' if len(ok) != 1 else ''} "
                    f"in {summary['seconds']:.2f} s; open it at https://ui.perfetto.dev or chrome://tracing."
                )
        for _, notes in ok:
            for note in notes:
                session.note(f"probe: {note}.")
        check_partial(answers, "timeline queries")
        return 0
