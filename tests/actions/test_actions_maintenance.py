"""`probe cleanup` and `probe debug` against real training processes."""

from __future__ import annotations

import json
import re
import socket

import pytest

from conftest import TARGETS, requires_torch

pytestmark = requires_torch
TRAIN = TARGETS / "actions_train.py"


def test_cleanup_reports_memory_and_frees_grads(spawn, cli):
    p = spawn([TRAIN, "--sched", "none"])
    r = cli(p.pid, "cleanup", "--zero-grad")
    assert r.returncode == 0, r.stderr
    assert re.search(r"gc collected \d+ objects; rss [\d.]+ \w+ -> [\d.]+ \w+", r.stdout), r.stdout
    freed = re.search(r"gradients freed (\d+) B", r.stdout)
    assert freed and int(freed.group(1)) == 4 * (8 * 16 + 16 + 16 + 1)
    r = cli(p.pid, "--format", "json", "cleanup")
    doc = json.loads(r.stdout)[0]["action"]
    assert doc["state"] == "done" and doc["step"] is not None and "rss" in doc["result"]["after"]


def test_debug_listens_on_loopback_once(spawn, cli):
    pytest.importorskip("debugpy")
    p = spawn([TRAIN, "--sched", "none"])
    r = cli(p.pid, "debug", "--port", "0")
    assert r.returncode == 0, r.stderr
    host, port = re.search(r"listening on (\S+):(\d+)", r.stdout).groups()
    assert host == "127.0.0.1"
    config = json.loads(r.stdout[r.stdout.index("{") :])
    assert config["request"] == "attach" and config["connect"] == {"host": "127.0.0.1", "port": int(port)}
    with socket.create_connection((host, int(port)), timeout=5):
        pass
    again = cli(p.pid, "debug", "--port", "0")
    assert again.returncode == 0 and f"already listening on 127.0.0.1:{port}" in again.stdout
    p.wait_for("step 3 ")  # training goes on
