"""``probe status``: one line per rank, with the odd one out (slow, hung, unreachable) visible at once."""

from __future__ import annotations

import json
import time

from probe._errors import PartialError, ProbeError

from . import Command, command


def _median(values):
    import statistics  # not on the CLI's start-up path

    return statistics.median(values)



def _classify(rows: list[dict], factor: float, hung_after: float) -> None:
    """Fill ``state`` of every row from its health, its stack and the other ranks' step times."""
    times = {r["rank"]: r["step_time"] for r in rows if r.get("step_time")}
    for r in rows:
        if r["state"] in ("unreachable", "hung"):
            continue
        stalled = r["health_state"] == "hung" or (r["age_s"] is not None and r["age_s"] > hung_after)
        if stalled:
            r["state"] = "waiting" if r["in_collective"] else "hung"
            continue
        others = [t for k, t in times.items() if k != r["rank"]]
        others_wait = [o["wait"] for o in rows if o is not r and o.get("wait") is not None]
        waits_for_it = (r.get("wait") is not None and others_wait and _median(others_wait) >= 0.5
                        and r["wait"] <= _median(others_wait) / 3)
        if (r.get("step_time") and others and r["step_time"] > factor * _median(others)) or waits_for_it:
            r["state"] = "slow"
        elif r["step"] is None:
            r["state"] = r["health_state"] or "idle"
        else:
            r["state"] = "training"


def _row(answer) -> dict:
    from probe.util.procfs import proc_state
    from .._stacks import top_frame

    t = answer.target
    row = {"rank": t.rank, "host": t.entry.get("host"), "pid": t.pid, "step": None, "age_s": None,
           "step_time": None, "state": None, "health_state": None, "in_collective": False, "wait": None, "top_frame": None}
    if not answer.ok:
        stopped = t.local_pid is not None and proc_state(t.local_pid) in ("T", "t")
        row["state"] = "hung" if stopped else "unreachable"
        row["top_frame"] = answer.error
        return row
    health, bt = answer.value
    server_now = (health.get("started_at") or 0) + (health.get("uptime_s") or 0)
    last = health.get("last_step_at")
    row.update(host=health.get("host") or row["host"], pid=health.get("pid") or row["pid"], step=health.get("step"),
               step_time=health.get("step_time"), health_state=health.get("state"),
               age_s=(server_now - last) if last else None)
    samples = [b for b in bt if b is not None]
    if samples:
        row["top_frame"] = top_frame(samples[-1])
        inside = [in_collective(b) for b in samples]
        row["in_collective"] = inside[-1]
        row["wait"] = sum(inside) / len(inside)
    return row


def in_collective(doc: dict) -> bool:
    """Whether the main thread of a backtrace sits inside a torch.distributed call."""
    from .._stacks import main_thread

    frames = (main_thread(doc) or {}).get("frames") or []
    return any("torch/distributed/" in str(f.get("file")) for f in frames)


@command("status", "One line per rank: host, pid, step, last step age, step time, state (training/slow/waiting/hung/unreachable), top frame.")
class Status(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--slow-factor", type=float, default=None,
                       help="Slow when the median step time exceeds the others' by this factor (default PROBE_STRAGGLER_FACTOR).")
        p.add_argument("--hung-after", type=float, default=None,
                       help="Hung (or waiting, inside a collective) after this many seconds without a step (default PROBE_HUNG_AFTER).")
        p.add_argument("--samples", type=int, default=5,
                       help="Main-thread stacks sampled per rank to measure time spent waiting in collectives (default 5).")
        p.add_argument("--interval", type=float, default=0.1, help="Seconds between stack samples (default 0.1).")

    def run(self, session, args):
        from probe._config import setting
        from probe.sql.engine import Result

        from .._fanout import fan_out
        from .._render import render_result

        try:
            factor = args.slow_factor if args.slow_factor is not None else setting("PROBE_STRAGGLER_FACTOR", strict=True)
            hung_after = args.hung_after if args.hung_after is not None else setting("PROBE_HUNG_AFTER", strict=True)
        except ValueError:
            raise ProbeError("PROBE_STRAGGLER_FACTOR and PROBE_HUNG_AFTER must be numbers.") from None
        if session.multi or session.args.endpoint or session.args.rank is not None:
            targets = session.targets()
        else:
            from .._endpoint import targets_for_ranks

            targets = targets_for_ranks(None, session.token)

        if args.samples < 1:
            raise ProbeError("--samples must be at least 1.")

        def ask(target):
            client = session.client(target)
            health = client.get("/health")
            stacks = []
            for i in range(args.samples):
                if i:
                    time.sleep(args.interval)  # ok-sleep: spacing of stack samples
                try:
                    stacks.append(client.get("/backtrace", thread="MainThread"))
                except ProbeError:
                    stacks.append(None)
            return health, stacks

        started = time.perf_counter()
        answers = fan_out(targets, ask)
        rows = [_row(a) for a in answers]
        _classify(rows, factor, hung_after)
        cols = ["rank", "host", "pid", "step", "age_s", "step_time", "wait", "state", "top_frame"]
        if session.format == "json":
            session.print(json.dumps([{c: r[c] for c in cols} for r in rows], indent=2, default=str))
        else:
            types = ["INTEGER", "VARCHAR", "BIGINT", "BIGINT", "DOUBLE", "DOUBLE", "VARCHAR", "VARCHAR", "VARCHAR"]
            for r in rows:
                r["age_s"] = round(r["age_s"], 1) if r["age_s"] is not None else None
                r["step_time"] = round(r["step_time"], 4) if r["step_time"] is not None else None
                r["wait"] = f"{r['wait']:.0%}" if r["wait"] is not None else None
            session.print(render_result(Result(cols, types, [[r[c] for c in cols] for r in rows],
                                               elapsed=time.perf_counter() - started), session.format))
        return PartialError.exit_code if any(not a.ok for a in answers) else 0
