"""tests/unit starts no process: conftest refuses one there, so a test that needs a target fails at once
and says where it belongs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_a_unit_test_that_starts_a_process_fails_naming_it():
    with pytest.raises(AssertionError, match=r"a unit test starts no process \(subprocess.Popen\)"):
        subprocess.run([sys.executable, "-c", "pass"])
    with pytest.raises(AssertionError, match=r"os.fork"):
        os.fork()
