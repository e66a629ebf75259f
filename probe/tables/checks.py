"""What is checked about training, and what the doctor and the guard read of it: the invariant checks
(``torch.checks``, ``probe.training.invariants``, one row per check per measured step), each rank's checksums of its
DDP replica's weights at the same steps (``torch.weight_sums``) and how its DistributedDataParallel models are set up
(``torch.ddp``, ``probe.training.weights``), a measured step's batch, update and loss scaling (``torch.batches``,
``torch.updates``, ``torch.scaler``, ``probe.training.signals``), and what the guard was armed with and caught
(``torch.guard``, ``probe.actions.guard``)."""

from __future__ import annotations

from ..actions.guard import events
from ..training.invariants import CHECK_COLUMNS, checks as _checks
from ..training.signals import BATCH_COLUMNS, SCALER_COLUMNS, UPDATE_COLUMNS, signals as _signals
from ..training.weights import DDP_COLUMNS, SUM_COLUMNS, replicas as _replicas
from .registry import Column, ring_rows, table


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
    return ring_rows(_checks(), CHECK_COLUMNS, lambda inv: inv.snapshot())


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
    return ring_rows(_replicas(), SUM_COLUMNS, lambda r: r.snapshot_sums())


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
    return ring_rows(_replicas(), DDP_COLUMNS, lambda r: r.snapshot_ddp())


_TIME = Column("time", "TIMESTAMP", "When it was read.")


def _rows(which: str, columns: dict) -> dict:
    return ring_rows(_signals(), columns, lambda sig: sig.snapshot(which))


@table(
    "torch.batches",
    "The batch of each measured step: a fingerprint of the primary model's first training input and of the class "
    "targets the loss saw, and how the labels of those targets are spread. Identical fingerprints step after step "
    "mean the job is fed the same batch; a batch of one class is a loader sorted by class, or broken labels.",
    columns=[
        Column("step", "BIGINT", "The measured step whose batch it is."),
        _TIME,
        Column(
            "input_hash",
            "VARCHAR",
            "A hash of the dtype and 256 evenly strided elements of the primary model's first training input of the "
            "step (its first tensor argument); the same on every rank for the same data. NULL when no input was seen.",
        ),
        Column(
            "target_hash",
            "VARCHAR",
            "The same for the class-index targets of the loss's classification term (cross_entropy, nll_loss), read "
            "from its autograd graph; NULL for another kind of loss.",
        ),
        Column("samples", "DOUBLE", "Target elements whose labels were counted (4,096 evenly strided at most)."),
        Column("labels", "DOUBLE", "Distinct labels among them (ignore_index and negative ones left out)."),
        Column("top_label", "DOUBLE", "The most frequent label."),
        Column("top_share", "DOUBLE", "Its share of the counted targets: 1 when the batch holds one class."),
    ],
    examples=[
        "SELECT step, input_hash, target_hash, labels, top_label, top_share FROM torch.batches ORDER BY step DESC "
        "LIMIT 10",
        "SELECT count(DISTINCT input_hash) AS distinct_batches, count(*) AS steps FROM torch.batches",
    ],
    kind="ring",
)
def batches_table(ctx):
    return _rows("batches", BATCH_COLUMNS)


@table(
    "torch.updates",
    "The update one optimizer step applied, per weight tensor (two or more dimensions, trainable, held by the lead "
    "optimizer; 32 at most, spread over the model): its size relative to the weights, measured on the step after "
    "each measured one over 1,024 strided elements. About 1e-3 is healthy; far smaller means the step hardly moves "
    "the weights (a tiny rate, over-clipping), far larger that it rewrites them.",
    columns=[
        Column("step", "BIGINT", "The optimizer step whose update it is."),
        _TIME,
        Column("parameter", "VARCHAR", "The tensor, by the model's name for it."),
        Column("ratio", "DOUBLE", "‖w after − w before‖ / ‖w before‖ over the sampled elements."),
        Column(
            "grad_ratio",
            "DOUBLE",
            "‖g‖ / ‖w before‖ over the same elements, g the gradient before clipping (the gradient the step applied, "
            "over clip_grad_norm_'s coefficient at the last measured step when the loop clips); NULL when the tensor "
            "had none. The update over it is the step's effective rate.",
        ),
        Column("lr", "DOUBLE", "The learning rate of the optimizer's first param group at that step."),
        Column(
            "norm",
            "DOUBLE",
            "‖w before‖ over the same elements: how large the weights are, so that weights an update grew many times "
            "over in a few steps show.",
        ),
    ],
    examples=[
        "SELECT step, parameter, ratio FROM torch.updates ORDER BY step DESC, ratio LIMIT 10",
        "SELECT parameter, median(ratio) AS ratio FROM torch.updates GROUP BY parameter ORDER BY ratio",
    ],
    kind="ring",
)
def updates_table(ctx):
    return _rows("updates", UPDATE_COLUMNS)


@table(
    "torch.scaler",
    "Mixed precision's loss scaling at each measured step: the GradScaler's scale (it halves at every step whose "
    "gradients overflowed, which the scaler then skips) and whether clip_grad_norm_ ran on gradients the scaler had "
    "not unscaled yet. No rows without an enabled GradScaler.",
    columns=[
        Column("step", "BIGINT", "The measured step."),
        _TIME,
        Column("scale", "DOUBLE", "The scaler's scale, read at the optimizer step (before the scaler's update)."),
        Column(
            "clip_scaled",
            "BOOLEAN",
            "clip_grad_norm_ ran on the gradients before scaler.unscale_(optimizer): it measured and clipped them "
            "multiplied by the scale.",
        ),
        Column(
            "clip_norm",
            "DOUBLE",
            "When clip_scaled, the norm it computed divided by the scale: the gradients' own (torch.steps.grad_norm "
            "shows this one).",
        ),
    ],
    examples=["SELECT step, scale, clip_scaled, clip_norm FROM torch.scaler ORDER BY step DESC LIMIT 10"],
    kind="ring",
)
def scaler_table(ctx):
    return _rows("scaler", SCALER_COLUMNS)


_GUARD_COLUMNS = (
    "event",
    "step",
    "time",
    "armed",
    "reason",
    "taken",
    "loss",
    "grad_norm",
    "median",
    "first_nonfinite",
    "evidence",
    "optimizer",
)


@table(
    "torch.guard",
    "The guard's events in this process, oldest first: each time it was armed or taken out, and every step it "
    "caught, with what it did and where its evidence is.",
    columns=[
        Column("event", "VARCHAR", "armed, disarmed or trigger."),
        Column(
            "step",
            "BIGINT",
            "The boundary it was armed or taken out at, or the step it caught (the number that step would have had: "
            "a skipped step is not counted, so the next applied step takes it).",
        ),
        Column("time", "TIMESTAMP", "When it happened."),
        Column("armed", "VARCHAR", "What was armed, as `probe guard` flags (--on ... --keep N --skip ...)."),
        Column("reason", "VARCHAR", "What triggered (a trigger's row): non-finite gradients or loss, a spike."),
        Column(
            "taken",
            "VARCHAR",
            "What the guard did: skipped the update, rolled back to the state before step S, or let the step go.",
        ),
        Column("loss", "DOUBLE", "The caught step's loss (NULL on several ranks, where it is not read)."),
        Column("grad_norm", "DOUBLE", "The caught step's total gradient norm, before the update."),
        Column("median", "DOUBLE", "The median gradient norm of the applied steps before it (the spike's base)."),
        Column(
            "first_nonfinite",
            "VARCHAR",
            "On a non-finite catch in a single process, the first module whose output was not finite when the step's "
            "kept batch ran again through the model ('' for the model itself); NULL otherwise.",
        ),
        Column("evidence", "VARCHAR", "The evidence bundle written for it (probe.load_evidence); NULL if none."),
        Column("optimizer", "VARCHAR", "The class of the optimizer whose step was caught."),
    ],
    examples=[
        "SELECT step, reason, taken, evidence FROM torch.guard WHERE event = 'trigger' ORDER BY step",
        "SELECT event, step, armed FROM torch.guard WHERE event <> 'trigger'",
    ],
    kind="ring",
)
def guard_table(ctx):
    return [tuple(e.get(c) for c in _GUARD_COLUMNS) for e in events()]
