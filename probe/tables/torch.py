"""torch tables of the steps: ``torch.steps``, module traces (``python.torch_trace``), memory, the loss
(``torch.loss``) and the host-device syncs of traced steps (``torch.syncs``).

The ring tables are filled by the hooks in ``probe.training.hooks``; ``torch.memory`` and ``torch.loss`` are
read at query time. None of them imports torch: without torch they are empty. What the optimizers hold
(``torch.optimizer``, ``torch.optimizer_steps``, ``torch.parameters``) is in ``optim``; the checks of training
and of DDP replicas in ``checks``.
"""

from __future__ import annotations

import sys

from ..training import hooks
from ..training.steprows import COLUMNS, snapshot
from ..training.trace import TRACE_COLUMNS
from ..util.procfs import rss_bytes
from .registry import Column, no_rows, ring_rows, table
from ..training.trace import SYNC_COLUMNS


@table(
    "torch.steps",
    "One row per training step (an optimizer step of the lead optimizer; with several optimizers in each iteration, "
    "the iteration's last optimizer step; or a probe.step() call): the core signals (loss, lr, duration, data_wait, "
    "memory) on every step however short (their few microseconds are kept even where they exceed PROBE_STEP_BUDGET, on "
    "steps under ~0.3 ms), the optional ones (grad_norm, samples, tokens, cpu_wait) on the steps measured marks.",
    columns=COLUMNS,
    examples=[
        "SELECT step, duration, loss, grad_norm, lr, tokens_per_s FROM torch.steps ORDER BY step DESC LIMIT 10",
        "SELECT COUNT(*) AS steps, AVG(probe_us) AS probe_us, 1e-6 * SUM(probe_us) / SUM(duration) AS probe_share, "
        "AVG(measured::INT) AS measured_share FROM torch.steps",
        "SELECT step, duration, compute, comm_wait, comm_wait / duration AS wait_share FROM torch.steps "
        "WHERE comm_wait IS NOT NULL ORDER BY step DESC LIMIT 10",
        "SELECT COUNT(*) AS steps, AVG(duration) AS avg_step_s, MIN(loss) AS best_loss, MAX(grad_norm) AS "
        "max_grad_norm "
        "FROM torch.steps WHERE step > (SELECT MAX(step) - 100 FROM torch.steps)",
    ],
    kind="ring",
)
def steps(ctx):
    tk = hooks.tracker()
    if tk is None:
        return no_rows(c.name for c in COLUMNS)
    cols = snapshot(tk)
    cols["compute"], cols["comm_wait"] = _comm_split(ctx, cols)
    return cols


def _comm_split(ctx, cols):
    """compute and comm_wait of each step from the creation times of the recorded collectives."""
    import numpy as np

    from ..training.frameworks import step_split
    from .collectives import recorder

    n = len(cols["step"])
    doc = recorder(ctx, frames=False) if n else None
    created = sorted(e["time_created_ns"] / 1e9 for e in (doc or {}).get("entries") or () if e.get("time_created_ns"))
    if not created:
        return np.ma.masked_all(n), np.ma.masked_all(n)
    first = np.searchsorted(cols["ended_at"], created[0])  # older steps lie before the recorder's window
    compute, wait = np.full(n, np.nan), np.full(n, np.nan)
    c, w = step_split(cols["started_at"][first:].tolist(), cols["ended_at"][first:].tolist(), created)
    compute[first:], wait[first:] = c, w
    return np.ma.masked_invalid(compute), np.ma.masked_invalid(wait)  # NaN here: no collective, i.e. NULL


@table(
    "python.torch_trace",
    "One row per traced module call of the sampled steps (PROBE_TRACE), with its time and memory.",
    columns=[
        Column("step", "BIGINT", "Step the call belongs to (the step in progress)."),
        Column("seq", "BIGINT", "Order of the call's start within its step, from 0."),
        Column(
            "module",
            "VARCHAR",
            "Dotted path of the module from its root model (e.g. blocks.3.attn); the root's own name for the root; the "
            "class name for modules outside any known model.",
        ),
        Column(
            "stage",
            "VARCHAR",
            "forward; backward (traced for each root model as a whole); or recompute: a module call made while "
            "autograd runs the backward pass, i.e. activation checkpointing (torch.utils.checkpoint) running the "
            "forward again, so that forward totals count each call once.",
        ),
        Column(
            "duration",
            "DOUBLE",
            "Seconds the call took: CUDA event time on GPU runs (NULL until the events complete), else wall-clock "
            "time.",
        ),
        Column(
            "allocated",
            "BIGINT",
            "Bytes in use when the call ended: CUDA allocated memory on GPU runs, else the process RSS (read at most "
            "every 0.5 ms).",
        ),
        Column("max_allocated", "BIGINT", "Largest allocated value seen so far in this step."),
        Column("time", "TIMESTAMP", "When the call started."),
        Column("rank", "INTEGER", "Global rank, NULL outside a distributed job."),
        Column(
            "depth",
            "INTEGER",
            "Nesting depth: 0 for a root model call, 1 for its children, and so on; a recompute row has the depth its "
            "module had in the step's forward.",
        ),
        Column("model", "VARCHAR", "Name of the root model the module belongs to, empty when unknown."),
        Column("module_type", "VARCHAR", "Class name of the module."),
        Column(
            "out_mean",
            "DOUBLE",
            "Mean of the call's output tensor (the output itself, else the first tensor of its tuple, list or dict), "
            "reduced on its device and read back lazily (PROBE_TRACE_STATS); NULL for backward rows, non-floating or "
            "non-CPU/CUDA outputs, and on CUDA until the copy lands.",
        ),
        Column("out_std", "DOUBLE", "Standard deviation (population) of all the output's elements; NULL as out_mean."),
        Column(
            "out_batch_std",
            "DOUBLE",
            "Standard deviation across the output's first (batch) dimension, averaged over the other positions: 0 when "
            "every sample gets the same output. NULL as out_mean, and when the first dimension has fewer than 2 "
            "entries.",
        ),
        Column(
            "out_zero_frac",
            "DOUBLE",
            "Fraction of the output's elements that are exactly 0 (dead ReLU units show here); NULL as out_mean.",
        ),
        Column("out_nonfinite", "BIGINT", "Count of NaN and infinite elements of the output; NULL as out_mean."),
        Column(
            "out_elements",
            "BIGINT",
            "Elements the out_* statistics cover: all of the output, or a strided sample of about 4 Mi elements of a "
            "larger one.",
        ),
        Column("out_shape", "VARCHAR", "Shape of the output tensor the statistics describe, e.g. [64, 32]."),
    ],
    examples=[
        "SELECT module, stage, COUNT(*) as count, AVG(duration) as avg_time, SUM(duration) as total_time "
        "FROM python.torch_trace WHERE step > (SELECT MAX(step) - 5 FROM python.torch_trace) "
        "GROUP BY module, stage ORDER BY total_time DESC LIMIT 10",
        "SELECT step, MAX(allocated) as peak_memory, MAX(allocated) - MIN(allocated) as memory_range "
        "FROM python.torch_trace WHERE step > (SELECT MAX(step) - 20 FROM python.torch_trace) GROUP BY step ORDER BY "
        "step",
        "SELECT module_type, COUNT(*) AS calls, SUM(duration) AS total_s FROM python.torch_trace "
        "WHERE stage = 'forward' AND depth > 0 GROUP BY module_type ORDER BY total_s DESC",
        "SELECT module, module_type, AVG(out_zero_frac) AS zeros, AVG(out_batch_std) AS batch_std, SUM(out_nonfinite) "
        "AS nonfinite "
        "FROM python.torch_trace WHERE stage = 'forward' AND step > (SELECT MAX(step) - 300 FROM python.torch_trace) "
        "GROUP BY module, module_type ORDER BY zeros DESC LIMIT 10",
    ],
    kind="ring",
)
def torch_trace(ctx):
    tr = hooks.tracer()
    if tr is None:
        return no_rows(TRACE_COLUMNS)
    tr.resolve()
    return tr.ring.snapshot()


_MEMORY_KEYS = (
    ("allocated", "allocated_bytes.all.current"),
    ("max_allocated", "allocated_bytes.all.peak"),
    ("reserved", "reserved_bytes.all.current"),
    ("max_reserved", "reserved_bytes.all.peak"),
    ("alloc_retries", "num_alloc_retries"),
    ("ooms", "num_ooms"),
)


@table(
    "torch.memory",
    "Memory per device: the CUDA caching allocator's figures for each GPU, and the process RSS on the cpu row.",
    columns=[
        Column("device", "VARCHAR", "cpu, or cuda:N."),
        Column("allocated", "BIGINT", "Bytes held by tensors now (CUDA), NULL on the cpu row."),
        Column("max_allocated", "BIGINT", "Peak of allocated since start or the last reset_peak_memory_stats (CUDA)."),
        Column("reserved", "BIGINT", "Bytes reserved by the caching allocator (CUDA)."),
        Column("max_reserved", "BIGINT", "Peak of reserved (CUDA)."),
        Column(
            "alloc_retries", "BIGINT", "Allocations that failed once and succeeded after freeing cached blocks (CUDA)."
        ),
        Column("ooms", "BIGINT", "Out-of-memory errors raised by the allocator (CUDA)."),
        Column("total", "BIGINT", "Device memory in bytes (CUDA), NULL on the cpu row."),
        Column("rss", "BIGINT", "Resident memory of the process in bytes (cpu row only)."),
    ],
    examples=[
        "SELECT device, allocated / 1e6 AS allocated_mb, reserved / 1e6 AS reserved_mb, ooms, rss / 1e6 AS rss_mb FROM "
        "torch.memory"
    ],
)
def memory(ctx):
    rows = [{"device": "cpu", "rss": rss_bytes()}]
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return rows
    for i in range(torch.cuda.device_count()):
        stats = torch.cuda.memory_stats(i)
        row = {"device": f"cuda:{i}", "total": torch.cuda.get_device_properties(i).total_memory}
        row.update({col: stats.get(key) for col, key in _MEMORY_KEYS})
        rows.append(row)
    return rows


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
    return ring_rows(hooks.tracer(), SYNC_COLUMNS, lambda tr: tr.syncs.ring.snapshot())
