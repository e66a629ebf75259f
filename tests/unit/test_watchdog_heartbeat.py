"""The hang watchdog is re-armed from step heartbeats, not at every step: re-arming it at every boundary would make
each boundary a full one and restart faulthandler's timer thread at every step.
tests/unit/test_quick_path.py runs it beside real optimizer steps; tests/process/test_hang.py fires it in real
processes."""

from __future__ import annotations

import faulthandler


def test_heartbeats_rearm_the_timer_at_most_every_rearm_s_and_late_enough(monkeypatch, tmp_path):
    from probe.agent import watchdog
    from probe.training import boundary

    armed = []
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda timeout, **kw: armed.append(timeout))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: None)
    clock = [1024.0]
    monkeypatch.setattr(watchdog, "_clock", lambda: clock[0])
    monkeypatch.setenv("PROBE_HANG_TIMEOUT", "60")
    monkeypatch.setenv("PROBE_RUNTIME_DIR", str(tmp_path))
    dog = watchdog.Watchdog.start()
    assert dog is not None
    try:
        for i in range(64):  # a second of steps, 1/64 s each (binary fractions: exact sums)
            clock[0] += 1 / 64
            boundary.passed(i)
    finally:
        dog.stop()
    # armed at install, then once per REARM_S of steps; each time for the timeout plus the heartbeat's possible lag
    assert len(armed) == 1 + int(1.0 / watchdog.REARM_S)
    assert set(armed) == {60 + watchdog.LATE_S}
