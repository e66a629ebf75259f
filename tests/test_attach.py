"""`probe inject`: start the probe in a plain Python process, and every diagnosis producible here."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TARGETS

PLAIN = TARGETS / "plain_loop.py"
needs_gdb = pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@needs_gdb
def test_inject_plain_process_then_query_and_inject_again(spawn, cli, probe_env):
    # given a Python process that never imported probe
    target = spawn(PLAIN)
    assert "probe=False" in target.wait_for("ready")
    # when
    first = cli("inject", target.pid)
    # then the server runs there and answers queries
    assert first.returncode == 0, first.stderr
    assert f"probe started in process {target.pid} via gdb" in first.stdout
    q = cli(target.pid, "query", "SELECT name, func FROM python.threads ORDER BY name", "--format", "json")
    assert q.returncode == 0, q.stderr
    rows = json.loads(q.stdout)
    assert {"name": "MainThread", "func": "main_loop"} in rows
    assert any(r["name"] == "plain-worker" for r in rows)
    listed = json.loads(cli("list", "--json").stdout)
    assert [r["pid"] for r in listed] == [target.pid]
    # and injecting twice is harmless
    again = cli("inject", target.pid)
    assert again.returncode == 0, again.stderr
    assert "already runs a probe" in again.stdout
    assert cli(target.pid, "query", "SELECT COUNT(*) AS n FROM python.threads").returncode == 0
    # no private file is left behind, and the runtime dir stays private
    rt = Path(probe_env["PROBE_RUNTIME_DIR"])
    assert not [p.name for p in rt.iterdir() if p.name.startswith("inject-")]
    assert stat.S_IMODE(rt.stat().st_mode) == 0o700
    assert target.popen.poll() is None


def test_nonexistent_pid(cli):
    r = cli("inject", _dead_pid())
    assert r.returncode == 10
    assert "no process with pid" in r.stderr and "Traceback" not in r.stderr


def test_not_a_python_process(spawn, cli):
    target = spawn(["sleep", "100"], ready=None)
    r = cli("inject", target.pid)
    assert r.returncode == 11, r.stderr
    assert "(sleep) is not a Python process" in r.stderr


def test_disabled_rungs_are_named_with_the_read_only_alternative(spawn, cli):
    target = spawn(PLAIN)
    r = cli("inject", target.pid, env={"PROBE_INJECT_VIA": "remote_exec"})
    assert r.returncode == 14, r.stderr
    assert "sys.remote_exec needs Python 3.14" in r.stderr
    assert "gdb is disabled by PROBE_INJECT_VIA" in r.stderr
    assert f"probe {target.pid} backtrace" in r.stderr


def test_no_gdb(spawn, cli, tmp_path):
    target = spawn(PLAIN)
    r = cli("inject", target.pid, env={"PROBE_GDB": str(tmp_path / "no-such-gdb")})
    assert r.returncode == 14, r.stderr
    assert "gdb is not installed" in r.stderr


@needs_gdb
def test_target_without_the_dependencies(spawn, cli):
    # python -S: no site-packages, so neither probe nor numpy are importable in the target (it needs
    # nothing else: DuckDB and sqlglot run in the CLI)
    target = spawn([sys.executable, "-S", str(PLAIN)])
    r = cli("inject", target.pid)
    assert r.returncode == 16, r.stderr
    assert "cannot import numpy," in r.stderr and "duckdb" not in r.stderr
    assert f"{sys.executable} -m pip install" in r.stderr
    assert target.popen.poll() is None  # the target lives on


def _other_python() -> str | None:
    mine = "%d.%d" % sys.version_info[:2]
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for exe in sorted(root.glob("3.*/bin/python3.*")):
        if exe.name.count(".") == 1 and exe.name != f"python{mine}" and exe.name >= "python3.8":
            return str(exe)
    return None


@pytest.mark.skipif(_other_python() is None, reason="no second Python minor version installed")
def test_python_version_mismatch_is_refused(spawn, cli):
    target = spawn([_other_python(), str(PLAIN)])
    r = cli("inject", target.pid)
    assert r.returncode == 15, r.stderr
    assert "runs Python 3." in r.stderr and "but this probe runs on" in r.stderr
