"""``probe status``: one line per rank, with the rank the others wait for named at once.

The classification is not computed here: ``status`` prints the ``ranks.status`` view
(``probe.sql.ranks``), the same one ``ranks.hung`` and ``ranks.stragglers`` select from,
and the doctor, the page and ``probe list`` (through ``states``) read, so they always agree.
"""

from __future__ import annotations

from probe._errors import ProbeError

from . import Command, command

COLUMNS = (
    "rank",
    "host",
    "pid",
    "step",
    "age_s",
    "step_time",
    "compute",
    "wait_share",
    "state",
    "culprit",
    "reason",
    "top_frame",
)
SQL = f"SELECT {', '.join(COLUMNS)} FROM ranks.status ORDER BY rank"


@command(
    "status",
    "One line per rank: step, step time, compute, share of time waiting for others, state "
    "(training/slow/waiting/hung/idle/unreachable), the culprit the others wait for, and why.",
)
class Status(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument(
            "--slow-factor",
            type=float,
            default=None,
            help=(
                "Slow when the compute time per step exceeds the others' median by this factor (default "
                "PROBE_STRAGGLER_FACTOR)."
            ),
        )
        p.add_argument(
            "--hung-after",
            type=float,
            default=None,
            help=(
                "Hung (or waiting, inside a collective) after this many seconds without a step (default "
                "PROBE_HUNG_AFTER)."
            ),
        )

    def run(self, session, args):
        from ..query_runner import federated_query
        from ..render import render_result

        for name, value in (("--slow-factor", args.slow_factor), ("--hung-after", args.hung_after)):
            if value is not None and value <= 0:
                raise ProbeError(f"{name} must be a positive number, not {value}.")
        params = {"straggler_factor": args.slow_factor, "hung_after": args.hung_after}
        targets = None
        if not (session.multi or session.args.endpoint or session.args.rank is not None):
            from ..plumbing.endpoint import targets_for_ranks

            targets = targets_for_ranks(None, session.token, session.args.job, agent=session.agent)
        result = federated_query(session, SQL, targets=targets, params=params)
        session.print(render_result(_rounded(result, session.format), session.format))
        return 0


def _rounded(result, fmt: str):
    """Figures rounded for reading; JSON keeps them exact."""
    if fmt == "json":
        return result
    idx = {c: i for i, c in enumerate(result.columns)}
    result.types = list(result.types)
    result.types[idx["wait_share"]] = "VARCHAR"
    for row in result.rows:
        for col, digits in (("age_s", 1), ("step_time", 4), ("compute", 4)):
            if row[idx[col]] is not None:
                row[idx[col]] = round(row[idx[col]], digits)
        share = row[idx["wait_share"]]
        row[idx["wait_share"]] = f"{share:.0%}" if share is not None and share == share else None
    return result


def states(session, groups: list) -> dict:
    """``{pid: {"state": ..., "reason": ...}}`` from ``ranks.status`` for each group of targets (the ranks of one job,
    or one process alone), the groups asked side by side; a group that cannot be classified is left out (its
    processes keep what their own ``/health`` says)."""
    from ..plumbing.fanout import parallel
    from ..query_runner import federated_query

    def classify(targets):
        try:
            result = federated_query(
                session, "SELECT pid, state, reason FROM ranks.status", targets=targets, partial=True
            )
        except ProbeError:
            return []
        return [dict(zip(result.columns, row)) for row in result.rows]

    out = {}
    for rows in parallel(groups, classify, workers=16):
        out.update({r["pid"]: r for r in rows or () if r["pid"] is not None})
    return out
