"""torch.batches, torch.updates and torch.scaler: what a measured step's data, optimizer update and loss scaling were
(``probe.training.signals``), one row per measured step (per weight tensor for the update)."""

from __future__ import annotations

from ..training.signals import BATCH_COLUMNS, SCALER_COLUMNS, UPDATE_COLUMNS, signals as _signals
from .registry import Column, table

_TIME = Column("time", "TIMESTAMP", "When it was read.")


def _rows(which: str, columns: dict) -> dict:
    sig = _signals()
    if sig is None:
        return {name: [] for name in columns}
    return sig.snapshot(which)


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
