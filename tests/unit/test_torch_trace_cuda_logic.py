"""The tracer's CUDA bookkeeping, run on CPU with a stand-in for torch.cuda's event API.

The GPU test (test_torch_gpu.py) runs the real thing where a GPU exists; this one keeps
the CUDA-only code (event pairs per call, durations filled in lazily once events
complete, events recycled, allocator bytes as `allocated`) exercised on every machine.
The stand-in events complete only when the test says so, like a busy GPU.
"""

from __future__ import annotations

import math
import time
import types

import numpy as np
import pytest

from conftest import requires_torch

pytestmark = requires_torch


class FakeEvent:
    """torch.cuda.Event's surface: record(), query(), elapsed_time() in milliseconds."""

    done = False  # class-wide: the "GPU" finishes everything recorded so far when set

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = time.perf_counter()

    def query(self):
        return FakeEvent.done

    def elapsed_time(self, end):
        assert FakeEvent.done, "elapsed_time() on an event that has not completed would synchronize"
        return (end.at - self.at) * 1000.0


class TorchWithFakeCuda:
    """The real torch module, with ``torch.cuda`` replaced by the stand-in."""

    def __init__(self, torch):
        self._torch = torch
        self.allocated = 4096
        self.cuda = types.SimpleNamespace(
            is_available=lambda: True,
            is_initialized=lambda: True,
            Event=FakeEvent,
            memory_allocated=lambda: self.allocated,
        )

    def __getattr__(self, name):
        return getattr(self._torch, name)


@pytest.fixture
def tracer():
    import torch

    from probe.training.trace import Tracer

    FakeEvent.done = False
    tr = Tracer(TorchWithFakeCuda(torch), every=1, capacity=1000)
    assert tr.cuda
    yield tr
    tr.close()


def test_durations_wait_for_the_events_then_fill_in(tracer):
    import torch
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    x = torch.randn(3, 4)
    tracer.prepare(1)
    loss = model(x).sum()
    loss.backward()
    tracer.finish(1, wall_offset=0.0)
    snap = tracer.ring.snapshot()
    # four module calls forward (the root and its three layers) and the root's backward pass
    assert sorted(zip(snap["stage"], snap["module_type"])) == [
        ("backward", "Sequential"),
        ("forward", "Linear"),
        ("forward", "Linear"),
        ("forward", "ReLU"),
        ("forward", "Sequential"),
    ]
    assert np.ma.getmaskarray(snap["duration"]).all()  # device time is unknown (NULL) until the events complete
    assert set(snap["allocated"]) == {4096.0}  # the allocator's bytes, not the RSS
    assert len(tracer.pending_events) == 5
    tracer.resolve()  # the GPU is still busy: nothing is read, nothing waits
    assert len(tracer.pending_events) == 5 and np.ma.getmaskarray(tracer.ring.snapshot()["duration"]).all()

    FakeEvent.done = True
    tracer.resolve()
    durations = tracer.ring.snapshot()["duration"]
    assert not isinstance(durations, np.ma.MaskedArray)  # every duration known now
    assert tracer.pending_events == [] and all(d >= 0 and not math.isnan(d) for d in durations)
    root = [d for d, s, depth in zip(durations, snap["stage"], snap["depth"]) if s == "forward" and depth == 0][0]
    assert root >= max(d for d, s, depth in zip(durations, snap["stage"], snap["depth"]) if depth == 1)
    assert len(tracer._event_pool) == 10  # both events of each call go back to the pool for reuse


def test_events_of_rows_that_left_the_ring_are_recycled_not_read(tracer):
    import torch
    import torch.nn as nn

    tracer.ring = type(tracer.ring)(dict(zip(tracer.ring.names, (a.dtype.str for a in tracer.ring.arrays.values()))), 3)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    tracer.prepare(1)
    with torch.no_grad():
        model(torch.randn(2, 4))
    tracer.finish(1, wall_offset=0.0)
    # five calls, a ring of three: only the three newest rows wait for their events
    assert len(tracer.pending_events) == 3
    tracer.prepare(2)
    with torch.no_grad():
        model(torch.randn(2, 4))
    tracer.finish(2, wall_offset=0.0)
    FakeEvent.done = True
    tracer.resolve()
    assert tracer.pending_events == []
    assert len(tracer._event_pool) == 2 * 6  # the first step's three pairs were dropped unread
    assert not any(math.isnan(d) for d in tracer.ring.snapshot()["duration"])


def _cuda_like(value: float):
    """A CPU scalar that the probe's checks take for a device one (``is_cuda``), like a loss on a GPU."""
    import torch

    class CudaLike(torch.Tensor):
        is_cuda = True
        is_cpu = False

    return torch.tensor(value).as_subclass(CudaLike)


class TorchWithPinnedStandIn(TorchWithFakeCuda):
    """As TorchWithFakeCuda, with pinned host buffers made as plain CPU tensors (no CUDA to pin with here)."""

    def empty(self, *args, pin_memory=False, **kwargs):
        self.pinned = getattr(self, "pinned", 0) + bool(pin_memory)
        return self._torch.empty(*args, **kwargs)


def test_a_device_loss_is_copied_without_a_sync_and_filled_in_when_its_event_completes():
    """Every step's loss on CUDA: the boundary's quick path copies it into a pinned buffer with an
    event and writes NULL; the row is filled in once the event has completed, never by waiting for it."""
    import torch

    from probe.training.steprows import snapshot
    from probe.training.hooks import InputCounter
    from probe.training.steps import StepTracker
    from probe.training.trace import Tracer

    FakeEvent.done = False
    fake = TorchWithPinnedStandIn(torch)
    tr = Tracer(fake, every=0, capacity=100)
    tk = StepTracker(fake, tr, InputCounter(fake))
    try:
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tk.set_lead(opt)
        tk.budget.share = 0.0  # nothing optional: after the forced first steps every boundary is a quick one
        tk.budget.max_gap_ns = None
        losses = [0.5 + i for i in range(12)]
        for v in losses:
            tk.capture.saw_backward(_cuda_like(v), None)  # what the backward wrapper notes
            tk.on_optimizer_step(opt)
        assert fake.pinned == len(losses)  # one pinned copy per step, quick path included
        # the GPU has not got there yet: the rows hold NULL (not ready), and a query does not wait for it
        snap = snapshot(tk)
        assert list(snap["step"]) == list(range(1, 13)) and snap["loss"].mask.all()
        assert not snap["measured"][5:].any()  # the later steps took the quick path
        # when: the events complete; then: every step's loss is there
        FakeEvent.done = True
        snap = snapshot(tk)
        assert list(snap["loss"]) == pytest.approx(losses)
    finally:
        tk.close()
        tr.close()
