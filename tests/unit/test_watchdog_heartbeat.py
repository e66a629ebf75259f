"""The hang watchdog is re-armed from step heartbeats, not at every step (issue 29: PROBE_HANG_TIMEOUT made every
boundary a full one and restarted faulthandler's timer thread at every step, ~20 % of a 1.8 ms step here). In the
test process, with torch's real optimizer hook on one optimizer; tests/test_hang.py fires it in real processes."""

from __future__ import annotations

import faulthandler

import pytest

from conftest import requires_torch


@pytest.fixture
def watchdog(monkeypatch, tmp_path):
    from probe.agent import watchdog

    monkeypatch.setenv("PROBE_HANG_TIMEOUT", "60")
    monkeypatch.setenv("PROBE_RUNTIME_DIR", str(tmp_path))
    assert watchdog.install()
    try:
        yield watchdog
    finally:
        watchdog.uninstall()


def test_heartbeats_rearm_the_timer_at_most_every_rearm_s_and_late_enough(monkeypatch, tmp_path):
    from probe.agent import watchdog
    from probe.training.safepoint import StepEvent, fire

    armed = []
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda timeout, **kw: armed.append(timeout))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: None)
    clock = [1024.0]
    monkeypatch.setattr(watchdog, "_clock", lambda: clock[0])
    monkeypatch.setenv("PROBE_HANG_TIMEOUT", "60")
    monkeypatch.setenv("PROBE_RUNTIME_DIR", str(tmp_path))
    assert watchdog.install()
    try:
        for i in range(64):  # a second of steps, 1/64 s each (binary fractions: exact sums)
            clock[0] += 1 / 64
            fire(StepEvent(i))
    finally:
        watchdog.uninstall()
    # armed at install, then once per REARM_S of steps; each time for the timeout plus the heartbeat's possible lag
    assert len(armed) == 1 + int(1.0 / watchdog.REARM_S)
    assert set(armed) == {60 + watchdog.LATE_S}


@requires_torch
def test_the_watchdog_leaves_the_quick_path_in_place(watchdog, monkeypatch):
    import torch

    from probe.training import safepoint
    from probe.training.steps import StepTracker
    from probe.training.trace import Tracer

    monkeypatch.setenv("PROBE_STEP_BUDGET", "0.0001")  # few measured steps: the rest may take the quick path
    tracer = Tracer(torch)
    tk = StepTracker(torch, tracer)
    full = []
    boundary = tk.boundary
    tk.boundary = lambda *a, **kw: (full.append(tk.step + 1), boundary(*a, **kw))
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.register_step_post_hook(lambda o, args, kwargs: tk.on_optimizer_step(o))
        x = torch.randn(8, 4)
        beat_before = watchdog._state["beat_at"]
        for _ in range(400):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert tk.step == 400
        assert watchdog.status()["hang_timeout"] == 60
        assert not safepoint.subscribers  # nothing runs at every step
        # the steps were heard (the full boundaries' heartbeats), and most boundaries were quick ones
        assert watchdog._state["beat_at"] > beat_before
        assert len(full) < 100, f"{len(full)} of 400 boundaries were full ones: {full[:20]}"
    finally:
        tk.close()
        tracer.close()
