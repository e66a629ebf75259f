"""Reading the job's objects never runs the job's code: a ``__class__`` property, a huge or blocking ``__repr__``
and 100 MB locals (tests/targets/hostile_objects.py) cost the training process nothing and lock nobody out."""

from __future__ import annotations

import re

from conftest import TARGETS, poll, requires_torch
from harness import last_step

pytestmark = requires_torch


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) / 1024


def test_finding_objects_never_reads_a_class_property(spawn, cli, tmp_path):
    # given a loop whose __main__ global has a __class__ property that says when it is read
    target = spawn(TARGETS / "hostile_objects.py")
    assert poll(lambda: last_step(target) >= 20, 60), target.output()[-2000:]  # boundaries scanned at 1, 2, 4, 8, 16
    # when the probe finds the loop's objects for a checkpoint, the torch tables, the status and an eval
    r = cli(target.pid, "checkpoint", str(tmp_path / "ck.pt"))
    assert r.returncode == 0, r.stdout + r.stderr
    for args in (
        ("query", "SELECT name, lr FROM torch.optimizer", "-f", "csv"),
        ("query", "SELECT name FROM torch.parameters", "-f", "csv"),
        ("status",),
        ("eval", "print(step > 0)"),
    ):
        r = cli(target.pid, *args)
        assert r.returncode == 0, (args, r.stdout + r.stderr)
    # then the property never ran, on any thread
    assert "__class__ read" not in target.output(), target.output()[-3000:]


def test_locals_are_described_without_building_huge_reprs_or_waiting_on_one(spawn, cli):
    # given a thread whose frame holds 100 MB of bytes and of str, a 100 MB __repr__ and a __repr__ that never returns
    target = spawn(TARGETS / "hostile_objects.py")
    peak = _peak_rss_mb(target.pid)
    # when the owner asks for that thread's locals
    r = cli(target.pid, "backtrace", "--locals", "--thread", "holder")
    # then the answer comes, each value cut short or described by its type
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "big_bytes = b'bbbb" in out and "<100000000 bytes>" in out, out
    assert "big_str = 'ssss" in out and "<100000000 characters>" in out, out
    assert re.search(r"huge = <__main__\.HugeRepr object at 0x[0-9a-f]+>", out), out
    assert re.search(r"blocking = <__main__\.BlockingRepr object at 0x[0-9a-f]+>", out), out
    assert max(map(len, out.splitlines())) < 1000, max(map(len, out.splitlines()))
    # and the process built none of those reprs: its peak memory stayed where it was
    grown = _peak_rss_mb(target.pid) - peak
    assert grown < 50, f"the training process's peak RSS grew by {grown:.0f} MB"
    # and its owner is still answered, locals included
    again = cli(target.pid, "backtrace", "--locals", "--thread", "holder")
    assert again.returncode == 0 and "blocking = <" in again.stdout, again.stdout + again.stderr
    q = cli(target.pid, "query", "SELECT count(*) AS n FROM python.threads", "-f", "csv")
    assert q.returncode == 0, q.stderr
    step = last_step(target)
    assert poll(lambda: last_step(target) > step, 60), "training stopped"
