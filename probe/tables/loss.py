"""``torch.loss``: what the probe knows of the training loss itself (its kind and class count)."""

from __future__ import annotations

from ..training import hooks
from .registry import Column, table


@table(
    "torch.loss",
    "The loss the training loop backpropagates, as its autograd graph shows it: for a classification loss "
    "(cross-entropy, NLL) the class count of its logits. One row once a measured step's loss has been seen, none "
    "before (or for a loop that never calls backward on a scalar).",
    columns=[
        Column(
            "function",
            "VARCHAR",
            "The autograd node of the loss's classification term, e.g. NllLossBackward0 (cross_entropy is log_softmax "
            "+ nll_loss); NULL for another kind of loss.",
        ),
        Column(
            "classes",
            "BIGINT",
            "Number of classes: the class dimension of the log-probabilities the loss saved (dim 1 of [N, C], the "
            "vocabulary of a language model's flattened logits); NULL when the loss is not a classification loss.",
        ),
        Column("logits_shape", "VARCHAR", "Shape of those log-probabilities, e.g. [512, 50257]."),
    ],
    examples=["SELECT function, classes, logits_shape FROM torch.loss"],
)
def loss(ctx):
    tk = hooks.tracker()
    if tk is None or tk.capture._loss_looks == 0:
        return []
    kind = tk.capture.loss_kind
    if kind is None:
        return [{"function": None, "classes": None, "logits_shape": None}]
    name, classes, shape = kind
    return [{"function": name, "classes": classes, "logits_shape": shape}]
