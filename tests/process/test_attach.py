"""`probe inject`: start the probe in a plain Python process, and every diagnosis producible here."""

from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=1)
def _gdb_calls_work() -> bool:
    """The test's own check, apart from the probe's canary: can gdb call getpid() in a stopped process here?

    On some kernel/CPU/gdb combinations (seen: gdb 13.1, AMX CPUs, kernel 6.18) gdb cannot restore a
    stopped thread's extended state after the call and the process dies; inject must then refuse.
    """
    victim = subprocess.Popen(["sleep", "60"])
    try:
        out = subprocess.run(
            ["gdb", "-nx", "--batch", "-p", str(victim.pid), "-ex", 'printf "ok=%d\\n", (int) getpid()'],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return f"ok={victim.pid}" in out.stdout + out.stderr
    finally:
        victim.kill()
        victim.wait()


def _refused_without_harm(cli, target, r) -> None:
    """Where gdb cannot call functions, inject says so and the target runs on untouched."""
    assert r.returncode == 14, r.stderr
    assert "gdb cannot call a function in a stopped process on this machine" in r.stderr, r.stderr
    assert f"probe {target.pid} backtrace" in r.stderr and "Traceback" not in r.stderr
    bt = cli(target.pid, "backtrace")  # read-only (py-spy): the process is alive and still in its loop
    assert bt.returncode == 0 and "main_loop" in bt.stdout, bt.stdout + bt.stderr
    assert target.popen.poll() is None


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
    if not _gdb_calls_work():
        return _refused_without_harm(cli, target, first)
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


def test_nonexistent_pid(cli, probe_env):
    # given: the files of an earlier injection whose target died before it ran the bootstrap
    rt = Path(probe_env["PROBE_RUNTIME_DIR"])
    dead = _dead_pid()
    left = [rt / f"inject-{dead}-0badcafe{ext}" for ext in (".json", ".py", ".status")]
    for f in left:
        f.write_text("{}")
    r = cli("inject", _dead_pid())
    assert r.returncode == 10
    assert "no process with pid" in r.stderr and "Traceback" not in r.stderr
    assert not any(f.exists() for f in left)  # swept by the next inject


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
    if not _gdb_calls_work():
        return _refused_without_harm(cli, target, r)
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


@needs_gdb
def test_after_inject_into_an_hf_trainer_its_own_step_shows_beside_probes(spawn, cli):
    # given: an HF Trainer run some steps in, that never imported probe
    target = spawn([TARGETS / "hf_trainer.py", "--step-sleep", "0.05"], timeout=180)
    target.wait_for("hf step 30", 180)
    # when
    r = cli("inject", target.pid, timeout=120)
    if not _gdb_calls_work():
        assert r.returncode != 0
        return
    assert r.returncode == 0, r.stdout + r.stderr

    # then: `probe list` shows the Trainer's global_step beside probe's own count (which starts at the inject)
    def listed():
        rows = json.loads(cli("list", "--json").stdout)
        row = next((x for x in rows if x["pid"] == target.pid), None)
        return row if row and row.get("framework_step") is not None and row.get("step") else None

    from conftest import poll

    row = poll(listed, 120)
    assert row, cli("list", "--json").stdout
    assert row["framework_counter"].endswith(".global_step"), row
    assert row["framework_step"] >= 30 and row["framework_step"] > row["step"], row
    table = cli("list", env={"COLUMNS": "400"})  # wide enough that no header is cut
    assert "framework_step" in table.stdout, table.stdout
