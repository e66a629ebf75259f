"""What is checked about training: the invariant checks (``torch.checks``, ``probe.training.invariants``, one row
per check per measured step), each rank's checksums of its DDP replica's weights at the same steps
(``torch.weight_sums``) and how its DistributedDataParallel models are set up (``torch.ddp``,
``probe.training.weights``).
"""

from __future__ import annotations

from ..training.invariants import CHECK_COLUMNS, checks as _checks
from .registry import Column, no_rows, table
from ..training.weights import DDP_COLUMNS, SUM_COLUMNS, replicas as _replicas


@table(
    "torch.checks",
    "Invariants of training checked on measured steps (gradients present at the step and cleared between steps, "
    "accumulation kept, one backward per loss, parameters that move and frozen ones that do not, the scheduler's pace, "
    "dropout and batch norm in training mode), one row per check and step, ok or not, naming what it is about.",
    columns=[
        Column("step", "BIGINT", "The measured step at whose boundary the check was made."),
        Column("time", "TIMESTAMP", "When it was made."),
        Column(
            "invariant",
            "VARCHAR",
            "grads_present (the lead optimizer's step found gradients), grads_reach (every trainable tensor it holds "
            "got one, when any did), grads_cleared (a tensor's gradient was None or "
            "zero at some backward since the last measured step), accumulation (with more backward passes than "
            "optimizer steps, the gradient was not cleared before every one), backward_once (no loss graph "
            "backpropagated twice in the step), params_move (sampled trainable tensors with a gradient and a learning "
            "rate changed), frozen_still (sampled frozen tensors an optimizer holds did not change), schedule (the "
            "lead optimizer's scheduler kept its declared pace), or train_mode (dropout and batch-norm modules in "
            "training mode).",
        ),
        Column("ok", "BOOLEAN", "Whether the invariant held."),
        Column(
            "subject",
            "VARCHAR",
            "What the check is about, by name: the parameter watched (grads_cleared, grads_present, accumulation), the "
            "tensors that broke it grouped by module prefix (params_move, frozen_still, grads_reach), the scheduler "
            "class (schedule), the repeated graph's node (backward_once), or the modules found in eval mode "
            "(train_mode).",
        ),
        Column(
            "value",
            "DOUBLE",
            "grads_cleared: backward passes seen; grads_reach: tensors without a gradient; grads_present: trainable "
            "tensors of the optimizer when none held a "
            "gradient (NULL when ok); accumulation: backward passes per optimizer step; backward_once: backward calls "
            "in the step; params_move, frozen_still: tensors that broke it; schedule: scheduler steps per optimizer "
            "step; train_mode: modules in eval mode.",
        ),
        Column("detail", "VARCHAR", "The evidence in words, NULL when there is nothing to add."),
    ],
    examples=[
        "SELECT step, invariant, ok, subject, detail FROM torch.checks ORDER BY step DESC, invariant LIMIT 10",
        "SELECT invariant, COUNT(*) AS checks, COUNT(*) FILTER (WHERE NOT ok) AS failed FROM torch.checks GROUP BY "
        "invariant",
    ],
    kind="ring",
)
def checks_table(ctx):
    inv = _checks()
    if inv is None:
        return no_rows(CHECK_COLUMNS)
    return inv.snapshot()


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
        return no_rows(SUM_COLUMNS)
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
        return no_rows(DDP_COLUMNS)
    return r.snapshot_ddp()
