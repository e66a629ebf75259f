"""torch.syncs: the host-device syncs seen on traced steps, by call site (probe.training.trace)."""

from __future__ import annotations

from ..training import hooks
from ..training.trace import SYNC_COLUMNS
from .registry import Column, table


@table(
    "torch.syncs",
    "Host-device syncs on traced steps of a CUDA job, one row per call site and step, from torch's sync debug mode "
    "(turned on for traced steps only, PROBE_TRACE_SYNCS).",
    columns=[
        Column("step", "BIGINT", "The traced step the syncs happened in."),
        Column("time", "TIMESTAMP", "When the site first synced in that step."),
        Column("rank", "INTEGER", "Global rank, NULL outside a distributed job."),
        Column(
            "file",
            "VARCHAR",
            "File of the call site: the first frame of the user's code on the stack (outside torch, probe and training "
            "frameworks).",
        ),
        Column("line", "INTEGER", "Line of the call site."),
        Column("function", "VARCHAR", "Function the call site is in."),
        Column("code", "VARCHAR", "Source text of the call site's line, e.g. total += loss.item()."),
        Column("count", "BIGINT", "Syncs at this site during the step."),
        Column(
            "origin",
            "VARCHAR",
            "user: the synchronising call is on that line itself; library: inside torch or a framework called from it "
            "(see via); probe: inside the probe.",
        ),
        Column(
            "via",
            "VARCHAR",
            "file:line of the innermost Python frame, where torch raised its warning (the same as the site for origin "
            "user).",
        ),
    ],
    examples=[
        "SELECT file, line, code, origin, SUM(count) AS syncs, COUNT(DISTINCT step) AS steps FROM torch.syncs GROUP BY "
        "ALL ORDER BY syncs DESC",
    ],
    kind="ring",
)
def syncs_table(ctx):
    tr = hooks.tracer()
    if tr is None:
        return {name: [] for name in SYNC_COLUMNS}
    return tr.syncs.ring.snapshot()
