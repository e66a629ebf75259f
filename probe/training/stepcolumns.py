"""The ``torch.steps`` columns: what the step boundary writes per step, and what a query sees, derived when asked."""

from __future__ import annotations

__all__ = ["RING_COLUMNS", "STEP_COLUMNS", "snapshot"]

# What the boundary writes per step (the ring's columns)...
RING_COLUMNS = {
    "step": "i8",
    "ended_at": "f8",
    "duration": "f8",
    "loss": "f8",
    "grad_norm": "f8",
    "lr": "f8",
    "traced": "b1",
    "measured": "b1",
    "samples": "f8",
    "tokens": "f8",
    "micro_batches": "i8",
    "optimizer": "O",
    "cpu_wait": "f8",
    "probe_us": "f8",
    "data_wait": "f8",
}
# ...and what a query sees (``snapshot``): the rest is derived when asked.
STEP_COLUMNS = {
    "step": "i8",
    "started_at": "f8",
    "ended_at": "f8",
    "duration": "f8",
    "loss": "f8",
    "grad_norm": "f8",
    "lr": "f8",
    "samples_per_s": "f8",
    "tokens_per_s": "f8",
    "peak_allocated": "f8",
    "rank": "f8",
    "traced": "b1",
    "samples": "f8",
    "tokens": "f8",
    "micro_batches": "i8",
    "optimizer": "O",
    "measured": "b1",
    "probe_us": "f8",
    "cpu_wait": "f8",
    "memory": "f8",
    "data_wait": "f8",
}


def snapshot(tracker) -> dict:
    """The ``torch.steps`` columns (STEP_COLUMNS) of ``tracker`` (a ``StepTracker``), oldest step first: the
    ring's, plus those derived from them now rather than at every boundary."""
    import numpy as np

    tracker.resolve()
    cols = tracker.ring.snapshot()
    rows = cols["step"] - 1  # one ring row per step, in order
    duration = cols["duration"]
    with np.errstate(divide="ignore", invalid="ignore"):
        per_s = np.ma.masked_where(duration <= 0, 1.0 / duration)  # NULL, not NaN, for a step of no length
    n = len(rows)
    memory, peak = tracker.memory.at(cols["ended_at"])
    return {
        "step": cols["step"],
        "started_at": cols["ended_at"] - duration,
        "ended_at": cols["ended_at"],
        "duration": duration,
        "loss": cols["loss"],
        "grad_norm": cols["grad_norm"],
        "lr": cols["lr"],
        "samples_per_s": cols["samples"] * per_s,
        "tokens_per_s": cols["tokens"] * per_s,
        "peak_allocated": peak,
        "memory": memory,
        "data_wait": cols["data_wait"],
        "rank": np.full(n, np.nan if tracker.rank is None else float(tracker.rank)),
        "traced": cols["traced"],
        "samples": cols["samples"],
        "tokens": cols["tokens"],
        "micro_batches": cols["micro_batches"],
        "optimizer": cols["optimizer"],
        "measured": cols["measured"],
        "probe_us": cols["probe_us"],
        "cpu_wait": cols["cpu_wait"],
    }
