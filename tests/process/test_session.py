"""One probe session in one process: ``probe.stop()`` removes everything ``probe.start()`` installed, and the
probe starts again after it (tests/targets/start_stop.py compares the process before a start and after its stop)."""

from __future__ import annotations

import json

from conftest import TARGETS
from harness import run_target


def test_stop_leaves_nothing_behind_and_start_works_again(probe_env):
    # given: the watchdog and the periodic post-mortem snapshot on, beside the torch hooks and the server
    env = {**probe_env, "PROBE_HANG_TIMEOUT": "60", "PROBE_POSTMORTEM_EVERY": "1"}
    # when
    done = run_target([str(TARGETS / "start_stop.py")], env, timeout=180)
    # then
    assert done.returncode == 0, done.stderr
    rounds = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["round"] for r in rounds] == [1, 2], done.stdout + done.stderr
    # what a running probe has in the process, each of which its stop must take out again
    installed = {
        "optimizer global hooks",
        "backward",
        "clip_grad_norm_",
        "threads",
        "signal handlers",
        "wakeup fd",
        "excepthooks",
        "faulthandler",
        "entry and socket",
        "step subscribers",
    }
    for r in rounds:
        assert r["served"] and installed <= set(r["installed"]), r
        assert r["steps"] == 5, r  # each start counts its own steps
        assert r["action"] == "cancelled", r  # the action waiting for a step boundary was dropped by stop
        assert r["left"] == {}, r
