"""PROBE modes: which processes of a launch tree start a probe (workers, all, PROBE_ONLY patterns)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import TARGETS

CHILD = TARGETS / "spawn_child.py"


@pytest.mark.parametrize(
    "env, parent, child",
    [
        ({"PROBE": "1"}, True, False),  # workers: not in subprocesses of a probed process
        ({"PROBE": "workers"}, True, False),
        ({"PROBE": "all"}, True, True),  # also in their subprocesses
        ({"PROBE": "1", "PROBE_ONLY": "spawn_*.py"}, True, True),  # a pattern matches wherever it is in the tree
        ({"PROBE": "1", "PROBE_ONLY": "train*.py,other.mod"}, False, False),
        ({"PROBE": "0"}, False, False),
    ],
)
def test_probe_modes_choose_the_processes(probe_env, env, parent, child):
    out = subprocess.run(
        [sys.executable, str(CHILD), "--spawn"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**probe_env, **env},
        cwd=probe_env["PROBE_RUNTIME_DIR"],
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"probed={parent}", f"child probed={child}"], out.stdout + out.stderr
