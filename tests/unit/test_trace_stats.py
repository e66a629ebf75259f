"""Output statistics of traced module calls (python.torch_trace out_*) and the host-device sync watch (torch.syncs).

In-process: the tracer and the watch are driven as the step boundary drives them. The
CUDA-only parts run here with stand-ins (no GPU on most test machines): the deferred read
of the statistics behind an event, and torch's sync warning, raised in the exact form
torch raises it. tests/doctor/test_doctor_faults_runtime.py drives the rules over a real job.
"""

from __future__ import annotations

import math
import threading
import types
import warnings

import pytest

from conftest import requires_torch

pytestmark = requires_torch

SYNC_WARNING = (
    "called a synchronizing CUDA operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:150.)"
)


def traced(model, *inputs, stats=True):
    import numpy as np
    import torch

    from probe.training.trace import Tracer

    tr = Tracer(torch, every=1, capacity=1000, stats=stats)
    tr.prepare(1)
    try:
        model(*inputs)
    finally:
        tr.finish(1, 0.0)
        tr.close()
    snap = tr.ring.snapshot()  # a masked (missing) value is SQL NULL: None here

    def value(col, i):
        return None if np.ma.getmaskarray(col)[i] else np.ma.getdata(col)[i]

    return {
        m: {k: value(snap[k], i) for k in snap} for i, m in enumerate(snap["module"]) if snap["stage"][i] == "forward"
    }


def test_statistics_are_those_of_the_first_floating_output():
    import torch
    import torch.nn as nn

    class Pair(nn.Module):  # returns a tuple: the statistics describe its first tensor
        def forward(self, x):
            return x * 2, x.sum()

    class Ids(nn.Module):  # an integer output: no statistics
        def forward(self, x):
            return (x > 0).long()

    torch.manual_seed(0)
    lin, relu = nn.Linear(8, 16), nn.ReLU()
    model = nn.Sequential(lin, relu, Pair())
    x = torch.randn(32, 8)
    x[3, 2] = float("nan")
    rows = traced(lambda v: (model(v), Ids()(v)), x)
    with torch.no_grad():
        out = relu(lin(x))
    r = rows["ReLU"]  # modules outside a known model are named by their class
    finite = out[torch.isfinite(out)]
    assert r["out_nonfinite"] == out.numel() - finite.numel() > 0  # a NaN input row poisons that row's outputs
    assert r["out_zero_frac"] == pytest.approx(float((out == 0).sum()) / out.numel())
    assert math.isnan(r["out_mean"])  # NaN in, NaN out: the count says why
    clean = traced(model, torch.ones(4, 8))["Pair"]
    assert clean["out_shape"] == "[4, 16]" and clean["out_elements"] == 64
    assert clean["out_batch_std"] == 0.0 and clean["out_std"] > 0  # same row for every sample, varied across units
    assert clean["out_nonfinite"] == 0
    y = torch.randn(32, 8) + 3.0
    row = traced(model, y)["Linear"]
    with torch.no_grad():
        ref = lin(y)
    assert row["out_mean"] == pytest.approx(float(ref.mean()), abs=1e-6)
    assert row["out_std"] == pytest.approx(float(ref.std(correction=0)), rel=1e-5)
    assert row["out_batch_std"] == pytest.approx(
        float(ref.var(0, correction=0).mean().sqrt()), rel=1e-5
    )  # RMS over units
    ids = traced(Ids(), x)["Ids"]
    assert ids["out_mean"] is None and ids["out_shape"] is None  # no floating output: NULL, not NaN


def test_statistics_off_leaves_the_columns_null():
    import torch
    import torch.nn as nn

    rows = traced(nn.Linear(4, 4), torch.randn(2, 4), stats=False)
    r = rows["Linear"]
    assert all(r[c] is None for c in ("out_mean", "out_std", "out_batch_std", "out_zero_frac", "out_nonfinite"))


def test_a_large_output_is_reduced_over_a_strided_view():
    import torch

    from probe.training.tracecalls import MAX_ELEMENTS, Batch, recorder

    x = torch.relu(torch.randn(3, 1024, 2048))  # 6.3 Mi elements
    x[::2] = 0.0
    x[1, 5, 7] = float("inf")
    entry = recorder(torch, cuda=False)(x)
    n = entry[5]
    assert n <= MAX_ELEMENTS < x.numel() and tuple(entry[6]) == (3, 1024, 2048)
    row = {k: v[0] for k, v in Batch(torch, [0], [entry]).columns().items()}
    assert row["out_elements"] == n and row["out_shape"] == "[3, 1024, 2048]"
    finite = x[torch.isfinite(x)]
    assert row["out_zero_frac"] == pytest.approx(float((finite == 0).sum()) / x.numel(), abs=0.02)
    assert row["out_nonfinite"] in (0, 1)  # a strided sample: the inf is counted if the sample holds it


class FakeEvent:
    done = False

    def record(self):
        pass

    def query(self):
        return FakeEvent.done


def test_deferred_statistics_land_only_once_their_copy_has():
    import numpy as np
    import torch

    from probe.training.tracecalls import Batch, recorder
    from probe.util.ring import Ring
    from probe.training.trace import TRACE_COLUMNS

    class OnDevice(Batch):  # CPU tensors, read the CUDA way: behind an event
        @staticmethod
        def deferred(device):
            return True

    fake = types.SimpleNamespace(stack=torch.stack, cat=torch.cat, cuda=types.SimpleNamespace(Event=FakeEvent))
    stat = recorder(torch, cuda=False)
    ring = Ring(TRACE_COLUMNS, 4)
    entries = [stat(torch.zeros(2, 3)), None, stat(torch.arange(6.0).reshape(3, 2))]
    FakeEvent.done = False
    batch = OnDevice(fake, range(0, 3), entries)
    cols = batch.columns()
    assert np.ma.getmaskarray(cols["out_mean"]).all() and list(cols["out_elements"][[0, 2]]) == [6, 6]
    ring.extend(cols, 3)
    assert not batch.write(ring)
    assert np.ma.getmaskarray(ring.snapshot()["out_zero_frac"]).all()  # NULL: not read before the copy has landed
    FakeEvent.done = True
    assert batch.write(ring)
    snap = ring.snapshot()
    assert list(snap["out_zero_frac"][[0, 2]]) == [1.0, 1 / 6] and np.ma.getmaskarray(snap["out_zero_frac"])[1]
    assert snap["out_mean"][2] == 2.5 and snap["out_batch_std"][0] == 0.0
    assert snap["out_std"][2] == pytest.approx(float(torch.arange(6.0).std(correction=0)))
    assert snap["out_batch_std"][2] == pytest.approx(2 * math.sqrt(2 / 3))  # columns 0,2,4 and 1,3,5: std 1.633 each
    late = OnDevice(fake, range(0, 1), [stat(torch.ones(2, 2))])  # rows overwritten before the copy lands
    ring.extend(late.columns(), 1)
    ring.extend({"step": np.zeros(4, "i8")}, 4)
    assert late.stale(ring.count, ring.capacity)


def test_the_sync_watch_counts_call_sites_and_leaves_other_warnings_alone():
    import torch

    from probe.training.trace import SyncWatch

    shown = []
    before = warnings.showwarning
    warnings.showwarning = lambda message, *a, **k: shown.append(str(message))
    try:
        watch = SyncWatch(torch, rank=None)
        watch.start(cuda=False)
        for _ in range(3):
            warnings.warn(SYNC_WARNING, stacklevel=1)  # the line torch would blame for loss.item()
        warnings.warn("something else", RuntimeWarning, stacklevel=1)
        t = threading.Thread(target=lambda: warnings.warn(SYNC_WARNING, stacklevel=1))  # not the training thread
        t.start()
        t.join()
        watch.stop(7)
        warnings.warn(SYNC_WARNING, stacklevel=1)  # the watch is off: the job's own handler sees it
        assert warnings.showwarning is not watch._hook
    finally:
        warnings.showwarning = before
    rows = watch.ring.snapshot()
    assert list(rows["step"]) == [7] and list(rows["count"]) == [3]
    assert rows["file"][0] == __file__ and rows["origin"][0] == "user"
    assert rows["code"][0] == "warnings.warn(SYNC_WARNING, stacklevel=1)  # the line torch would blame for loss.item()"
    assert rows["function"][0] == "test_the_sync_watch_counts_call_sites_and_leaves_other_warnings_alone"
    assert shown == ["something else", SYNC_WARNING]
