"""``probe list``: the probed processes of this host (and of PROBE_REGISTRY), or with --dead the post-mortem records."""

from __future__ import annotations

import json
import time

from probe._errors import AuthError, ProbeError

from . import Command, command, format_flag


@command(
    "list", "List probed processes on this host (and in PROBE_REGISTRY) grouped by job: job, pid, rank, step, endpoint."
)
class List(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
        format_flag(p)
        p.add_argument(
            "--dead",
            action="store_true",
            help="List processes that died (post-mortem records): pid, rank, cause, when, last step.",
        )

    def run(self, session, args):
        if args.dead:
            return _list_dead(session, args)
        from probe._runtime import offline_status, read_entries

        from ..plumbing.client import Client
        from ..plumbing.endpoint import from_entry

        entries = read_entries(clean=True)

        def health(entry):
            try:
                # each entry with its own token: a typed one goes only where the person pointed a command
                return Client(from_entry(entry, None), timeout=min(session.timeout, 2.0)).get("/health")
            except AuthError as exc:  # not the process the entry names, or a token that does not fit: say which
                return {"unreachable": exc.message, "refused": True}
            except ProbeError as exc:
                return {"unreachable": exc.message, **offline_status(entry)}  # a hang dump explains a silent server

        from ..plumbing.fanout import parallel

        states = parallel(entries, health, workers=32)
        classified = _classified(session, entries, states)
        rows = []
        for e, h in zip(entries, states):
            endpoint = e.get("socket") if not e.get("shared") else f"{e.get('host')}:{e.get('tcp_port')}"
            if e.get("tcp_port") and not e.get("shared"):
                endpoint += f" tcp:{e.get('tcp_host')}:{e['tcp_port']}"
            # the state status and the doctor give (ranks.status); a process that could not be asked keeps its own
            said = classified.get(e["pid"]) or {}
            state = said.get("state") or h.get("state") or ("unreachable" if "unreachable" in h else "running")
            rows.append(
                {
                    "job": e.get("job"),
                    "pid": e["pid"],
                    "rank": e.get("rank"),
                    "world_size": e.get("world_size"),
                    "host": e.get("host"),
                    "step": h.get("step"),
                    "framework_step": h.get("framework_step"),
                    "framework_counter": h.get("framework_counter"),
                    "state": state,
                    "hung_since": h.get("hung_since"),
                    "endpoint": endpoint,
                    "command": " ".join(e.get("argv", []))[:80],
                    # why it is in that state: status's reason, or why it did not answer
                    "reason": said.get("reason") or h.get("unreachable"),
                }
            )
            if h.get("refused") and not (args.json or session.format == "json"):
                session.note(f"pid {e['pid']}: {h['unreachable']}")
        # grouped by job (processes outside a job last), ranks in order within each
        rows.sort(key=lambda r: (r["job"] is None, str(r["job"]), r["rank"] is None, r["rank"] or 0, r["pid"]))
        return _print_rows(
            session,
            args,
            rows,
            {
                "job": "VARCHAR",
                "pid": "BIGINT",
                "rank": "INTEGER",
                "world_size": "INTEGER",
                "host": "VARCHAR",
                "step": "BIGINT",
                **({"framework_step": "BIGINT"} if any(r["framework_step"] is not None for r in rows) else {}),
                "state": "VARCHAR",
                "endpoint": "VARCHAR",
                "command": "VARCHAR",
            },
            "No probed processes found. Start one with `import probe.auto`, PROBE=1, or `probe inject PID`.",
        )


def _classified(session, entries: list, health: list) -> dict:
    """``{pid: ranks.status row}`` for the processes that answered: the ranks of each job together (a rank is
    judged beside its peers), every other process alone."""
    from ..plumbing.endpoint import from_entry
    from .status import states

    jobs: dict = {}
    for e, h in zip(entries, health):
        if "unreachable" in h or h.get("step") is None:  # nothing to judge before a step (idle) or without an answer
            continue
        try:
            target = from_entry(e, None)
        except ProbeError:
            continue
        key = e.get("job") if e.get("job") is not None and e.get("rank") is not None else ("pid", e["pid"])
        jobs.setdefault(key, []).append(target)
    return states(session, list(jobs.values())) if jobs else {}


def _print_rows(session, args, rows: list, shown: dict, empty: str) -> int:
    """Rows (dicts) as JSON, or ``empty`` as a note, or a table of the ``shown`` columns (name -> type)."""
    if args.json or session.format == "json":
        session.print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        session.note(empty)
        return 0
    from ..render import render_rows

    session.print(render_rows(list(shown), list(shown.values()), [[r[c] for c in shown] for r in rows], session.format))
    return 0


def _list_dead(session, args) -> int:
    """``probe list --dead``: the post-mortem records of processes that are gone."""
    from ..plumbing.postmortem import dead_records

    rows = [
        {
            "pid": m["pid"],
            "rank": m.get("rank"),
            "job": m.get("job"),
            "cause": m["cause"],
            "when": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(m["time"]))),
            "last_step": m.get("last_step"),
            "what": m.get("summary"),
            "record": m["path"],
        }
        for m in dead_records()
    ]
    return _print_rows(
        session,
        args,
        rows,
        {
            "pid": "BIGINT",
            "rank": "INTEGER",
            "cause": "VARCHAR",
            "when": "VARCHAR",
            "last_step": "BIGINT",
            "what": "VARCHAR",
        },
        "No post-mortem records: no probed process has died here (records live in the runtime directory).",
    )
