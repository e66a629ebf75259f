"""torch.weight_sums and torch.ddp: each rank's checksums of its DDP replica's weights at the same steps, and how
its DistributedDataParallel models are set up (``probe.training.weights``)."""

from __future__ import annotations

from ..training.weights import DDP_COLUMNS, SUM_COLUMNS, replicas as _replicas
from .registry import Column, table


@table(
    "torch.weight_sums",
    "Checksums of each DistributedDataParallel model's parameter tensors on this rank, one row per tensor at the same "
    "steps on every rank (multiples of torch.ddp.every): a fixed sample of each tensor's elements, so ranks whose "
    "checksums differ at a step hold different weights.",
    columns=[
        Column("step", "BIGINT", "The step at whose boundary (after the optimizer step) the checksum was taken."),
        Column("time", "TIMESTAMP", "When it was taken."),
        Column("model", "VARCHAR", "The DDP-wrapped model, by the name probe found it under."),
        Column("position", "BIGINT", "The tensor's place in the model's named_parameters order, from 0."),
        Column(
            "name", "VARCHAR", "The parameter's dotted name inside the wrapped module (without DDP's module. prefix)."
        ),
        Column("numel", "BIGINT", "The tensor's number of elements."),
        Column(
            "checksum",
            "DOUBLE",
            "A weighted sum, in float64, of at most 64 of its elements at fixed, evenly strided positions: equal on "
            "every rank while the replicas agree.",
        ),
        Column(
            "collectives",
            "BIGINT",
            "How many collectives the DDP model's process group had issued on this rank by this step (its sequence "
            "number; the same on every row of the step): equal on every rank while they run the same collectives. "
            "NULL where the group does not count them, or is smaller than the job (data parallel inside pipeline or "
            "tensor parallel, whose other groups run other collectives).",
        ),
    ],
    examples=[
        "SELECT step, name, checksum FROM torch.weight_sums ORDER BY step DESC, position LIMIT 10",
        "SELECT model, max(step) AS last, count(DISTINCT step) AS checksums FROM torch.weight_sums GROUP BY model",
    ],
    kind="ring",
)
def weight_sums(ctx):
    r = _replicas()
    if r is None:
        return {name: [] for name in SUM_COLUMNS}
    return r.snapshot_sums()


@table(
    "torch.ddp",
    "The DistributedDataParallel models of this rank and how they are set up (broadcast_buffers, "
    "find_unused_parameters, its batch-norm modules), with the sample DDP's own logger last took; read on the training "
    "thread at refreshes (steps 1, 2, 4, ... and every 500).",
    columns=[
        Column("model", "VARCHAR", "The DDP-wrapped model, by the name probe found it under."),
        Column("world_size", "BIGINT", "Ranks in the default process group."),
        Column(
            "broadcast_buffers",
            "BOOLEAN",
            "Whether DDP broadcasts rank 0's buffers (batch-norm running statistics) at each forward.",
        ),
        Column(
            "find_unused_parameters",
            "BOOLEAN",
            "Whether DDP walks the autograd graph after each forward to find parameters that will get no gradient.",
        ),
        Column("static_graph", "BOOLEAN", "Whether DDP was told the graph is the same every iteration."),
        Column(
            "iteration",
            "BIGINT",
            "The iteration of DDP's logger's last sample (it samples iterations 10, 20, ..., 100, 1000, ...).",
        ),
        Column(
            "unused_parameter_size",
            "BIGINT",
            "Bytes of parameters DDP found unused at that sample (with find_unused_parameters).",
        ),
        Column("unused_seen", "BIGINT", "The most unused bytes any sample probe read has shown."),
        Column(
            "norm_modules",
            "VARCHAR",
            "The model's BatchNorm modules that keep running statistics and are not SyncBatchNorm, by name (NULL when "
            "none).",
        ),
        Column("every", "BIGINT", "Steps between weight checksums (torch.weight_sums) on this rank."),
        Column("tensors", "BIGINT", "Parameter tensors each checksum covers."),
    ],
    examples=["SELECT model, broadcast_buffers, find_unused_parameters, norm_modules FROM torch.ddp"],
)
def ddp(ctx):
    r = _replicas()
    if r is None:
        return {name: [] for name in DDP_COLUMNS}
    return r.snapshot_ddp()
