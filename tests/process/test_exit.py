"""A probed process exits cleanly on every Python the machine has (3.10-3.13): no traceback at exit
(3.12 refuses new threads at interpreter shutdown) and no socket or registry entry left behind."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT


def interpreters() -> list[str]:
    found = {f"{sys.version_info.major}.{sys.version_info.minor}": sys.executable}
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    for minor in ("3.10", "3.11", "3.12", "3.13"):
        for exe in sorted(glob.glob(os.path.join(root, "versions", f"{minor}.*", "bin", "python"))):
            found.setdefault(minor, exe)
    return [found[k] for k in sorted(found)]


CODE = """
import os, sys
sys.path.insert(0, {root!r})
import probe.auto  # noqa: F401
import probe
assert probe.is_running()
print("running", "pid", os.getpid(), sorted(os.listdir(os.environ["PROBE_RUNTIME_DIR"])))
"""


@pytest.mark.parametrize("python", interpreters())
def test_clean_exit_leaves_nothing_behind(python, probe_env):
    rt = probe_env["PROBE_RUNTIME_DIR"]
    r = subprocess.run(
        [python, "-c", CODE.format(root=str(ROOT))], env=probe_env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert ".sock" in r.stdout and ".json" in r.stdout, r.stdout  # it really was serving
    # On every version, numpy or not: pyenv's 3.10/3.12/3.13 here lack numpy, and then the post-mortem
    # record (numpy's npz) is not written, but its writer fails inside its own try and says nothing.
    assert "can't create new thread" not in r.stderr and "agent/lifecycle.py" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Error" not in r.stderr, r.stderr
    pid = int(re.search(r"pid (\d+)", r.stdout).group(1))
    assert not os.path.exists(os.path.join(rt, f"{pid}.sock")) and not os.path.exists(os.path.join(rt, f"{pid}.json"))
