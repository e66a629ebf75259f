"""``probe PID profile``: sample every thread's stack for N seconds; write a flamegraph's data."""

from __future__ import annotations

import os
import time

from probe._errors import ProbeError

from . import Command, command
from probe.util.printable import printable

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

        from ..ui.flame import to_collapsed, to_speedscope, to_svg

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
