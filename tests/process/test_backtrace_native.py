"""`backtrace --native` on a live, answering process: py-spy's native frames merged with the probe's."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import TARGETS, requires_torch
from harness import ptrace_refused
from probe.injector import pyspy_path

pytestmark = [requires_torch, pytest.mark.skipif(pyspy_path() is None, reason="py-spy is not installed")]


def test_native_frames_merge_with_the_probes_python_frames(spawn, cli, tmp_path):
    stall = tmp_path / "stall"
    stall.write_text("")
    target = spawn([TARGETS / "actions_train.py", "--sched", "none", "--stall-file", stall], ready="stalled at step")
    r = cli(target.pid, "--format", "json", "backtrace", "--native", "--locals", "--thread", "MainThread")
    if r.returncode != 0 and (why := ptrace_refused()):  # the host's rule, checked apart: not this command's word
        pytest.skip(f"this host refuses ptrace ({why}): {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["source"] == "probe+py-spy" and "merged with the probe's" in doc["note"]
    (main,) = doc["threads"]
    frames = main["frames"]
    assert [f["depth"] for f in frames] == list(range(len(frames)))
    assert any(f["native"] for f in frames), "py-spy's native frames are there"
    loop = next(f for f in frames if f["func"] == "main" and f["file"].endswith("actions_train.py"))
    assert loop["native"] is False
    assert "step" in (loop.get("locals") or {}), "the Python frame carries the probe's locals"
    assert main["daemon"] is False  # the probe's thread details (py-spy does not know them)
    assert doc["native_merge"]["from_probe"] >= 2
    text = cli(target.pid, "backtrace", "--native").stdout
    assert "[native]" in text and "merged with the probe's" in text.splitlines()[0]
    # the same frames as SQL: python.backtrace's is_native column says which frames are C/C++
    sql = "SELECT depth, func, file, is_native FROM python.backtrace WHERE thread_name = 'MainThread' ORDER BY depth"
    r = cli(target.pid, "query", "--native", sql, "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["depth"] for row in rows] == list(range(len(rows)))
    assert any(row["is_native"] for row in rows) and not all(row["is_native"] for row in rows)
    assert any(
        row["func"] == "main" and row["file"].endswith("actions_train.py") and not row["is_native"] for row in rows
    )
    plain = json.loads(cli(target.pid, "query", sql, "--format", "json").stdout)
    assert plain and not any(row["is_native"] for row in plain)  # without --native: the process's own view, Python only
    assert len(plain) < len(rows)


FORKED = """
import os, sys, threading, time
pid = os.fork()  # threading is imported: the child's main thread keeps this process's thread id (CPython)
if pid:
    print(f"child {pid}", flush=True)
    os.waitpid(pid, 0)
    sys.exit(0)
import probe.auto
def train():
    while True:
        time.sleep(0.01)  # ok-sleep: a loop for the probe to read
print("ready", flush=True)
train()
"""


def test_a_forked_process_main_thread_is_its_own(spawn, cli):
    """A process started by fork (a rank started with start_method="fork"): its main thread's id is its own pid,
    not the parent's that CPython leaves on threading.main_thread(), so /proc, py-spy and the threads agree."""
    parent = spawn([sys.executable, "-c", FORKED], ready="ready")
    child = int(parent.wait_for("child ").split()[1])
    r = cli(child, "query", "SELECT native_id, state, cpu_user_s FROM python.threads WHERE is_main", "-f", "json")
    assert r.returncode == 0, r.stderr
    (main,) = json.loads(r.stdout)
    assert main["native_id"] == child and main["state"] is not None and main["cpu_user_s"] is not None, main
    r = cli(child, "--format", "json", "backtrace", "--native", "--thread", "MainThread")
    if r.returncode != 0 and (why := ptrace_refused()):
        pytest.skip(f"this host refuses ptrace ({why}): {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    (thread,) = json.loads(r.stdout)["threads"]  # one main thread: py-spy's and the probe's merged
    assert thread["native_id"] == child and any(f["func"] == "train" for f in thread["frames"]), thread
