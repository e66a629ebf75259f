"""``torch.loss``: what the probe knows of the training loss itself (its kind and class count)."""

from __future__ import annotations

from ..training import hooks
from .registry import Column, table


@table(
    "torch.loss",
    "The loss the training loop backpropagates, as its autograd graph shows it: for a classification loss "
    "(cross-entropy, NLL, binary cross-entropy with logits) the class count of its logits and what made them. One "
    "row once a measured step's loss has been seen, none before (or for a loop that never calls backward on a "
    "scalar).",
    columns=[
        Column(
            "function",
            "VARCHAR",
            "The autograd node of the loss's classification term, e.g. NllLossBackward0 (cross_entropy is log_softmax "
            "+ nll_loss) or BinaryCrossEntropyWithLogitsBackward0; NULL for another kind of loss.",
        ),
        Column(
            "classes",
            "BIGINT",
            "Number of classes: the class dimension of the log-probabilities the loss saved (dim 1 of [N, C], the "
            "vocabulary of a language model's flattened logits); NULL when the loss is not a classification loss.",
        ),
        Column("logits_shape", "VARCHAR", "Shape of those log-probabilities, e.g. [512, 50257]."),
        Column(
            "made_by",
            "VARCHAR",
            "The operations that made the classification term's input, nearest first, as autograd names them (up "
            "to 3; reshapes and views skipped): LogSoftmaxBackward0 <- AddmmBackward0 is cross_entropy on a linear "
            "layer's logits, LogSoftmaxBackward0 <- SoftmaxBackward0 is cross_entropy given probabilities.",
        ),
    ],
    examples=["SELECT function, classes, logits_shape, made_by FROM torch.loss"],
)
def loss(ctx):
    tk = hooks.tracker()
    if tk is None or tk.capture._loss_looks == 0:
        return []
    kind = tk.capture.loss_kind
    if kind is None:
        return [{"function": None, "classes": None, "logits_shape": None, "made_by": None}]
    name, classes, shape, made = kind
    return [{"function": name, "classes": classes, "logits_shape": shape, "made_by": made}]
