"""torch.collectives and torch.process_groups: torch's c10d flight recorder as tables.

Both are read at query time from the recorder (``probe.training.frameworks``); without
torch.distributed, a process group, or the recorder on, they are empty.
"""

from __future__ import annotations

from ..training import frameworks as recorder_io
from .registry import Column, table


def recorder(ctx, frames: bool = True, only_active: bool = False) -> dict | None:
    """One dump of the flight recorder per kind and query (tables read in the same query share it)."""
    key = ("flight_recorder", frames, only_active)
    if key not in ctx.hints:
        ctx.hints[key] = recorder_io.dump(frames=frames, only_active=only_active)
    return ctx.hints[key]


@table(
    "torch.collectives",
    "One row per collective or p2p operation this rank issued, from torch's c10d flight recorder (the last "
    "PROBE_COLLECTIVES).",
    columns=[
        Column("pg", "VARCHAR", "Process group id as the recorder names it (0 is the default group)."),
        Column("pg_desc", "VARCHAR", "Process group description, e.g. default_pg."),
        Column("record_id", "BIGINT", "Position of the entry in the recorder, counted from 0 since the start."),
        Column(
            "seq",
            "BIGINT",
            "Collective sequence id within the process group (the same collective has the same seq on every rank); "
            "NULL for p2p.",
        ),
        Column("p2p_seq", "BIGINT", "Point-to-point sequence id within the process group; NULL for collectives."),
        Column("op_id", "BIGINT", "Operation id within the process group (collectives and p2p together)."),
        Column("is_p2p", "BOOLEAN", "Whether the entry is a send/recv rather than a collective."),
        Column("backend", "VARCHAR", "Backend that ran it: gloo, nccl, ..."),
        Column("op", "VARCHAR", "Operation, e.g. all_reduce, broadcast, allgather, send."),
        Column("input_sizes", "VARCHAR", "Shapes of the input tensors, e.g. [[36]]."),
        Column("input_dtypes", "VARCHAR", "Element types of the input tensors, e.g. [Float]."),
        Column("output_sizes", "VARCHAR", "Shapes of the output tensors."),
        Column("output_dtypes", "VARCHAR", "Element types of the output tensors."),
        Column(
            "state",
            "VARCHAR",
            "scheduled, started or completed: the recorder's state, completed once the work finished (gloo reports no "
            "start).",
        ),
        Column("retired", "BOOLEAN", "Whether the work finished and left the recorder's active set."),
        Column("created_at", "TIMESTAMP", "When this rank issued it (enqueued it to the backend)."),
        Column(
            "started_at",
            "TIMESTAMP",
            "When the backend started it, where the backend reports it (NCCL with timing), else NULL.",
        ),
        Column("completed_at", "TIMESTAMP", "When the backend finished it, where reported, else NULL."),
        Column(
            "duration",
            "DOUBLE",
            "Seconds it ran, where the backend times it (NCCL with TORCH_NCCL_ENABLE_TIMING), else NULL.",
        ),
        Column("timeout_s", "DOUBLE", "The process group's timeout for it in seconds."),
        Column("thread", "VARCHAR", "Name of the thread that issued it."),
        Column(
            "call_site",
            "VARCHAR",
            "The innermost issuing frame outside torch: func (file:line), e.g. the training loop's backward call; "
            "'probe: func (file:line)' when the probe issued it itself (an eval, an action), never credited to the "
            "user's frame below.",
        ),
        Column("frames", "VARCHAR", "The Python frames that issued it, innermost first, separated by '; '."),
        Column(
            "step",
            "BIGINT",
            "The training step (torch.steps) in progress when it was issued; NULL before the oldest step kept.",
        ),
    ],
    examples=[
        "SELECT pg, seq, op, input_sizes, state, created_at, call_site FROM torch.collectives ORDER BY record_id DESC "
        "LIMIT 10",
        "SELECT op, input_sizes, COUNT(*) AS n FROM torch.collectives GROUP BY ALL ORDER BY n DESC",
        "SELECT pg, seq, op, input_sizes, frames FROM torch.collectives WHERE NOT retired",
    ],
)
def collectives(ctx):
    read = ctx.hints.get("columns")
    frames = read is None or bool({"frames", "call_site"} & read)  # the frames cost most of a dump: only when read
    rows = recorder_io.entry_rows(recorder(ctx, frames=frames))
    steps = _step_of([r["created_at"] for r in rows])
    for row, step in zip(rows, steps):
        row["step"] = step
    return rows


def _step_of(times: list) -> list:
    """The training step in progress at each time: the first step (torch.steps) that ended after it."""
    from ..training import hooks
    from ..training.steprows import snapshot

    tk = hooks.tracker()
    if tk is None or not times:
        return [None] * len(times)
    import numpy as np

    cols = snapshot(tk)
    ended, started, numbers = cols["ended_at"], cols["started_at"], cols["step"]
    n = len(numbers)
    out = []
    for t, i in zip(times, np.searchsorted(ended, [t or 0.0 for t in times])):
        if not t or (n and i == 0 and t < started[0]):
            out.append(None)  # unknown time, or before the oldest step the ring keeps
        else:
            out.append(int(numbers[i]) if i < n else (int(numbers[-1]) + 1 if n else 1))
    return out


@table(
    "torch.process_groups",
    "One row per process group the flight recorder knows: its ranks and the last sequence ids it enqueued, started and "
    "completed.",
    columns=[
        Column("pg", "VARCHAR", "Process group id (0 is the default group)."),
        Column("pg_desc", "VARCHAR", "Process group description, e.g. default_pg."),
        Column("ranks", "VARCHAR", "Global ranks in the group, e.g. [0, 1, 2]."),
        Column("last_enqueued", "BIGINT", "Sequence id of the last collective this rank issued in the group."),
        Column(
            "last_started",
            "BIGINT",
            "Sequence id of the last collective the backend started, NULL where not reported (gloo).",
        ),
        Column("last_completed", "BIGINT", "Sequence id of the last collective that finished."),
        Column("pending", "INTEGER", "Collectives issued in the group that have not finished."),
        Column("pending_seq", "BIGINT", "Sequence id of the oldest unfinished collective: the one this rank waits in."),
        Column("pending_op", "VARCHAR", "Its operation, e.g. all_reduce."),
        Column("pending_sizes", "VARCHAR", "Its input shapes."),
        Column("pending_dtypes", "VARCHAR", "Its input element types."),
        Column("pending_since", "TIMESTAMP", "When this rank issued it."),
        Column("pending_s", "DOUBLE", "Seconds it has been unfinished, on this rank's clock."),
        Column("pending_site", "VARCHAR", "The innermost issuing frame outside torch: func (file:line)."),
    ],
    examples=[
        "SELECT pg, pg_desc, ranks, last_enqueued, last_completed, pending, pending_seq, pending_op, pending_s "
        "FROM torch.process_groups"
    ],
)
def process_groups(ctx):
    read = ctx.hints.get("columns")
    doc = recorder(ctx, frames=read is None or "pending_site" in read, only_active=True)
    rows = recorder_io.group_rows(doc)
    active = [e for e in recorder_io.entry_rows(doc) if not e["retired"] and not e["is_p2p"]]
    for row in rows:
        mine = sorted((e for e in active if e["pg"] == row["pg"]), key=lambda e: e["seq"] or 0)
        oldest = mine[0] if mine else {}
        row.update(
            pending=len(mine),
            pending_seq=oldest.get("seq"),
            pending_op=oldest.get("op"),
            pending_sizes=oldest.get("input_sizes"),
            pending_dtypes=oldest.get("input_dtypes"),
            pending_since=oldest.get("created_at"),
            pending_site=oldest.get("call_site"),
            pending_s=(ctx.time - oldest["created_at"]) if oldest.get("created_at") else None,
        )
    return rows
