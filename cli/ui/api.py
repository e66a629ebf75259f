"""What the page asks for, answered through the CLI's session, client and fan-out.

Each function takes the ``Session`` of the ``probe ui`` invocation (its ENDPOINT, --rank
or --ranks) and returns plain JSON-able data. Queries go through the CLI's federation
(``run_sql`` for the page's own SQL, ``job_doc`` for ``probe status``'s).
"""

from __future__ import annotations

import argparse
import io
import math

from probe._errors import PartialError, ProbeError


def run_sql(session, sql: str, max_rows: int | None = None):
    """One read-only query on the session's process(es); returns a ``Result``.

    The one place the page's queries reach the query path, the CLI's federation: a single
    process is federation with one process (its snapshots, DuckDB here); ``--ranks`` adds
    a ``rank`` column and joins across ranks.
    """
    from ..query_runner import federated_query

    if session.multi:
        try:
            return federated_query(session, sql, max_rows=max_rows)
        except PartialError as exc:  # the rows of the ranks that answered were printed to the session's buffer
            raise ProbeError(exc.message) from None
    return federated_query(session, sql, max_rows=max_rows, targets=[session.target()])


def _finite(value):
    """JSON has no NaN or Infinity: send them as strings the page turns back into numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def query_doc(session, sql: str, max_rows: int | None = None) -> dict:
    result = run_sql(session, sql, max_rows=max_rows)
    return {
        "columns": result.columns,
        "types": result.types,
        "elapsed": result.elapsed,
        "truncated": result.truncated,
        "rows": [[_finite(v) for v in row] for row in result.rows],
    }


def tables_doc(session) -> dict:
    """The live schema: the tables of the first process that answers (ranks share one registry)."""
    from ..plumbing.fanout import fan_out

    answers = fan_out(session.targets()[:4], lambda t: session.client(t).get("/tables"))
    for a in answers:
        if a.ok:
            return {
                "tables": [
                    {
                        "name": t["name"],
                        "description": t["description"],
                        "columns": [{"name": c["name"], "type": c["type"]} for c in t["columns"]],
                    }
                    for t in a.value["tables"]
                ]
            }
    raise ProbeError(f"no process answered to list its tables: {answers[0].target.label}: {answers[0].error}.")


def job_doc(session) -> dict:
    """One row per process: ``probe status``'s columns and classification (the ``ranks.status`` view)."""
    from ..query_runner import federated_query
    from ..commands.status import SQL

    res = federated_query(session, SQL)
    cols = ["rank", "host", "pid", "step", "age_s", "step_time", "state", "top_frame"]
    idx = {c: i for i, c in enumerate(res.columns)}
    return {"columns": cols, "rows": [[_finite(r[idx[c]]) for c in cols] for r in res.rows]}


def stacks_doc(session) -> dict:
    """The main thread's stack of every process, identical stacks merged (``backtrace --group``)."""
    from ..plumbing.fanout import fan_out
    from ..stacks import group_stacks
    from ..stacks import backtrace_doc

    args = argparse.Namespace(thread=None, locals=False, native=False, subprocesses=False)
    answers = fan_out(session.targets(), lambda t: backtrace_doc(session, t, args))
    by_pid = all(a.rank is None for a in answers)  # plain processes: name them by pid, not as ranks
    groups = [
        {
            "ranks": list(ranks),
            "label": f"pid {', '.join(map(str, ranks))}" if by_pid else label,
            "summary": summary,
            "frames": [{k: f.get(k) for k in ("func", "file", "lineno", "line")} for f in frames],
        }
        for ranks, label, summary, frames in group_stacks(answers)
    ]
    failed = [{"label": a.target.label, "error": a.error} for a in answers if not a.ok]
    return {"groups": groups, "failed": failed, "processes": len(answers)}


def profile_doc(session, seconds: float, native: bool = False) -> dict:
    """Sampled stacks of every process over ``seconds``, merged (each rank's under its own root with --ranks)."""
    from ..plumbing.fanout import fan_out
    from ..commands.profile import fetch_profile, merge

    targets = session.targets()
    answers = fan_out(targets, lambda t: fetch_profile(session, t, seconds, native))
    docs = [(a.target.label, a.value) for a in answers if a.ok]
    if not docs:
        raise ProbeError(f"no process answered the profile: {answers[0].target.label}: {answers[0].error}.")
    return {
        "stacks": merge(docs, by_rank=len(targets) > 1),
        "seconds": seconds,
        "native": native,
        "failed": [{"label": a.target.label, "error": a.error} for a in answers if not a.ok],
    }


def findings_doc(session) -> dict:
    """The doctor's findings (``probe doctor --format json``), most severe first."""
    from ..doctor import diagnose

    return diagnose(session).to_dict()


# What the page may start with --allow-actions: command name -> the options it may pass.
ACTIONS = {
    "cleanup": (),
    "checkpoint": ("path",),
    "lr": ("scale", "set"),
    "guard": ("on", "skip", "rollback", "off"),
}


def action_doc(session, name: str, params: dict) -> dict:
    """Run an action command exactly as the CLI would (``probe ... NAME ... --yes``); return its output."""
    from ..plumbing.main import build_parser
    from ..plumbing.session import Session
    from ..commands import COMMANDS

    if name not in ACTIONS:
        raise ProbeError(f"the page can start only {', '.join(sorted(ACTIONS))}; use the CLI for {name}.")
    argv = [name]
    for key in ACTIONS[name]:
        value = params.get(key)
        if value in (None, ""):
            continue
        if key == "path":
            argv.insert(1, str(value))
        elif value is True:  # a flag (guard --skip)
            argv.append(f"--{key}")
        elif value is not False:
            argv += [f"--{key}", str(value)]
    a = session.args
    if a.endpoint:
        argv += ["-t", a.endpoint]
    if a.rank is not None:
        argv += ["--rank", str(a.rank)]
    if getattr(a, "ranks", None):
        argv += ["--ranks", a.ranks]
    if session.token:
        argv += ["--token", session.token]
    argv += ["--timeout", str(session.timeout), "--yes"]
    parser, _ = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        raise ProbeError(f"the page sent arguments `{name}` does not take: {params}.") from None
    out, err = io.StringIO(), io.StringIO()
    try:
        code = int(COMMANDS[name]().run(Session(args, stdout=out, stderr=err), args) or 0)
    except ProbeError as exc:
        return {"exit_code": exc.exit_code, "output": out.getvalue() + err.getvalue(), "error": exc.message}
    return {
        "exit_code": code,
        "output": out.getvalue() + err.getvalue(),
        "command": "probe " + " ".join(x for x in argv if x != session.token),
    }
