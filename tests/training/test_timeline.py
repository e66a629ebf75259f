"""User spans (python.spans) and `probe trace`: Chrome trace-event JSON checked against the format."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import TARGETS, poll, requires_torch
from harness import query_json

pytestmark = requires_torch
SPANS = TARGETS / "spans_train.py"


@pytest.fixture(scope="module")
def ranks(shared_spawn):
    """Two processes of one (pretend) job, rank 0 and rank 1, tracing every step; the tests only read them, a few
    steps each, so they step every ~50 ms for the whole file rather than keep a core busy."""
    env = {"PROBE_TRACE": "all", "WORLD_SIZE": "2"}
    return [
        shared_spawn([SPANS, "--step-sleep", "0.05"], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)
    ]


def wait_for_steps(cli, pid, n):
    assert poll(
        lambda: (query_json(cli, pid, "SELECT MAX(step) AS s FROM torch.steps")[0]["s"] or 0) >= n, 60, interval=0.1
    ), f"fewer than {n} steps within 60 s"


def test_spans_record_nesting_threads_and_decorated_functions(ranks, shared_cli):
    pid = ranks[0].pid
    wait_for_steps(shared_cli, pid, 4)
    rows = query_json(
        shared_cli,
        pid,
        "SELECT name, step, depth, parent, thread, duration FROM python.spans "
        "WHERE step = (SELECT MAX(step) - 1 FROM torch.steps) ORDER BY time",
    )
    main = [(r["name"], r["depth"], r["parent"]) for r in rows if r["thread"] == "MainThread"]
    assert main == [("step", 0, None), ("data", 1, "step"), ("compute", 1, "step"), ("loss", 2, "compute")]
    assert {r["name"] for r in rows if r["thread"] == "prefetcher"} <= {"prefetch"}
    by = {r["name"]: r["duration"] for r in rows if r["thread"] == "MainThread"}
    assert by["step"] >= by["data"] + by["compute"] > 0
    # the table's own example (data share of step time) runs
    r = shared_cli(pid, "query", "SELECT name, COUNT(*) AS n FROM python.spans GROUP BY name")
    assert r.returncode == 0 and "prefetch" in r.stdout


def test_span_is_a_no_op_without_a_probe():
    code = (
        "import sys, probe\n"
        "@probe.span('f')\n"
        "def f(x): return x + 1\n"
        "with probe.span('data') as s:\n"
        "    y = f(1)\n"
        "from probe._core import spans\n"
        "print(y, spans.ring(), 'probe.agent.lifecycle' in sys.modules, repr(s))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "None", "False", "probe.span('data')"]
    bad = subprocess.run(
        [sys.executable, "-c", "import probe; probe.span('')"], capture_output=True, text=True, timeout=60
    )
    assert "probe.span needs a name" in bad.stderr


def _check_format(doc: dict) -> list[dict]:
    """The trace-event format: phases, µs timestamps and durations, named tracks; returns the slices."""
    assert doc["displayTimeUnit"] == "ms" and isinstance(doc["traceEvents"], list)
    named = set()
    slices = []
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M", "i"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index"), e
            if e["name"] == "thread_name":
                named.add((e["pid"], e["tid"]))
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
            slices.append(e)
        assert (e["pid"], e["tid"]) in named, f"event on an unnamed track: {e}"
    return slices


def _nests(slices: list[dict]) -> None:
    """On every track, two slices are either disjoint or one contains the other."""
    tracks: dict = {}
    for e in slices:
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for key, evs in tracks.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list = []
        for e in evs:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - 1e-3:
                stack.pop()
            if stack:
                parent = stack[-1]
                assert e["ts"] + e["dur"] <= parent["ts"] + parent["dur"] + 1e-3, (
                    f"{e['name']} overlaps {parent['name']} on track {key} without nesting"
                )
            stack.append(e)


def test_trace_of_two_ranks_is_valid_trace_event_json(ranks, shared_cli, tmp_path):
    for p in ranks:
        wait_for_steps(shared_cli, p.pid, 4)
    out = tmp_path / "trace.json"
    r = shared_cli("--ranks", "all", "trace", "--steps", "3", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "events from 2 processes" in r.stdout
    doc = json.loads(out.read_text())
    slices = _check_format(doc)
    _nests(slices)
    names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert {pid for pid, _ in names} == {0, 1}  # one process track per rank, pid = rank
    assert any(n.startswith("rank 1 · pid ") for _, n in names)
    threads = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "thread_name"}
    for rank in (0, 1):
        assert {(rank, t) for t in ("steps", "forward", "backward", "spans: MainThread")} <= threads
    steps = [e for e in slices if e["cat"] == "step" and e["pid"] == 0]
    assert len(steps) == 3
    # durations are in microseconds: compare one with the table's seconds
    row = query_json(
        shared_cli, ranks[0].pid, f"SELECT duration FROM torch.steps WHERE step = {steps[-1]['args']['step']}"
    )
    assert steps[-1]["dur"] == pytest.approx(row[0]["duration"] * 1e6, rel=1e-6)
    # user spans nest inside their step's slice in time, and the module trace lies inside the trace window
    step_span = [e for e in slices if e["cat"] == "span" and e["name"] == "step" and e["pid"] == 0][-1]
    inner = [
        e
        for e in slices
        if e["cat"] == "span"
        and e["pid"] == 0
        and e["tid"] == step_span["tid"]
        and e["args"].get("step") == step_span["args"]["step"]
        and e["name"] != "step"
    ]
    assert {e["name"] for e in inner} == {"data", "compute", "loss"}
    assert all(
        step_span["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step_span["ts"] + step_span["dur"] + 1e-3 for e in inner
    )
    assert any(e["cat"] == "module,backward" for e in slices) and any(
        e["name"] == "0" or "Linear" in str(e["args"]) for e in slices
    )


def test_trace_bad_input_is_one_sentence(ranks, shared_cli, tmp_path):
    r = shared_cli(ranks[0].pid, "trace", "--steps", "0", "-o", tmp_path / "t.json")
    assert r.returncode != 0 and "--steps must be at least 1" in r.stderr and "Traceback" not in r.stderr
    r = shared_cli(ranks[0].pid, "trace", "-o", tmp_path / "missing" / "t.json")
    assert r.returncode != 0 and "cannot write" in r.stderr and "Traceback" not in r.stderr
    r = shared_cli(ranks[0].pid, "--format", "json", "trace", "-o", "-")
    assert r.returncode == 0 and json.loads(r.stdout)["traceEvents"]


def test_trace_output_is_never_written_through_a_planted_name(ranks, shared_cli, tmp_path):
    import os

    # given a link planted at the output's old temporary name, one at the output itself, and a folder others may write
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "t.json.tmp").symlink_to(victim)
    (tmp_path / "link.json").symlink_to(victim)
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o775)
    # when the trace is written under each name
    r = shared_cli(ranks[0].pid, "trace", "--steps", "1", "-o", tmp_path / "t.json")
    # then the output is a new file of its own, and the link's target is untouched
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"] and victim.read_text() == "keep me"
    assert not (tmp_path / "t.json").is_symlink() and (tmp_path / "t.json.tmp").is_symlink()
    # and a link at the output, or a folder where others could swap the file, is refused with one sentence
    for out, fragment in ((tmp_path / "link.json", "is a symbolic link"), (group / "t.json", "not sticky")):
        r = shared_cli(ranks[0].pid, "trace", "--steps", "1", "-o", out)
        assert r.returncode == 1 and fragment in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert victim.read_text() == "keep me" and os.listdir(group) == []
    assert sorted(os.listdir(tmp_path)) == ["group", "link.json", "t.json", "t.json.tmp", "victim.txt"]


def test_doctor_names_an_input_bound_job_from_its_data_spans(spawn, cli):
    job = spawn([SPANS, "--data-sleep", "0.05"])
    said = {}

    def data_spans() -> list:
        said["r"] = r = cli(job.pid, "doctor", "--format", "json", timeout=90)
        assert "Traceback" not in r.stderr, r.stderr
        return [f for f in json.loads(r.stdout)["findings"] if f["rule"] == "data_spans"] if r.stdout.strip() else []

    hit = poll(data_spans, 90, interval=0.5)
    assert hit, said["r"].stdout + said["r"].stderr
    assert "probe.span('data')" in hit[0]["message"] and "input pipeline" in hit[0]["message"]
