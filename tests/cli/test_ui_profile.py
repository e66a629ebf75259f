"""`probe PID profile`: every thread's stack sampled over N seconds, written as collapsed stacks,
speedscope JSON or an SVG flamegraph; the page's flamegraph reads the same route."""

from __future__ import annotations

import json
import threading
import xml.etree.ElementTree as ET

import pytest

from conftest import TARGETS, poll
from harness import ptrace_refused


@pytest.fixture(scope="module")
def idle(shared_spawn):
    return shared_spawn(TARGETS / "idle.py")


def _stacks(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        out[stack] = int(n)
    return out


def test_collapsed_stacks_name_every_thread_and_the_loop(idle, shared_cli):
    r = shared_cli(idle.pid, "profile", "--seconds", "1")
    assert r.returncode == 0, r.stderr
    stacks = _stacks(r.stdout)
    main = {s: n for s, n in stacks.items() if s.startswith("thread MainThread;")}
    worker = [s for s in stacks if s.startswith("thread data-worker;")]
    assert worker, r.stdout
    # root first: the module, then main_loop, both in idle.py
    assert any(";main_loop (idle.py:" in s for s in main), r.stdout
    assert all(s.split(";")[1].startswith("<module> (idle.py:") for s in main), r.stdout
    # about 100 Hz for 1 s on the main thread (a loaded machine samples less often, never more)
    assert 5 <= sum(main.values()) <= 110, main
    # the server thread that answers is not in its own profile
    assert not any("serve_forever" in s and "profile (profile.py" in s for s in stacks)


def test_svg_and_speedscope_files(idle, shared_cli, tmp_path):
    svg_path, ss_path = tmp_path / "p.svg", tmp_path / "p.json"
    r = shared_cli(idle.pid, "profile", "--seconds", "0.5", "-o", svg_path)
    assert r.returncode == 0, r.stderr
    assert "wrote svg of" in r.stderr
    root = ET.parse(svg_path).getroot()  # well-formed XML
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert any(t.startswith("main_loop (idle.py:") for t in titles), titles[:20]
    r = shared_cli(idle.pid, "profile", "--seconds", "0.5", "--format", "speedscope", "-o", ss_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(ss_path.read_text())
    names = [f["name"] for f in doc["shared"]["frames"]]
    prof = doc["profiles"][0]
    assert prof["type"] == "sampled" and len(prof["samples"]) == len(prof["weights"]) > 0
    assert all(0 <= i < len(names) for s in prof["samples"] for i in s)
    assert any(n.startswith("main_loop (idle.py:") for n in names)


def test_profile_output_is_never_written_through_a_planted_link(idle, shared_cli, tmp_path):
    # given a link planted where the profile is to be written
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "p.txt").symlink_to(victim)
    # when a profile is asked to go there
    r = shared_cli(idle.pid, "profile", "--seconds", "0.2", "-o", tmp_path / "p.txt")
    # then it is refused with one sentence before sampling, and the link's target is untouched
    assert r.returncode == 1 and "is a symbolic link" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert victim.read_text() == "keep me" and (tmp_path / "p.txt").is_symlink()
    # and a new name in the same folder gets the profile
    r = shared_cli(idle.pid, "profile", "--seconds", "0.2", "-o", tmp_path / "p2.txt")
    assert r.returncode == 0 and "main_loop (idle.py:" in (tmp_path / "p2.txt").read_text(), r.stderr


def test_bad_arguments_and_a_second_profile_are_refused(idle, shared_cli):
    r = shared_cli(idle.pid, "profile", "--seconds", "0")
    assert r.returncode != 0 and "--seconds must be above 0" in r.stderr and "Traceback" not in r.stderr
    r = shared_cli(idle.pid, "profile", "--seconds", "1", "--format", "png")
    assert r.returncode != 0 and "invalid choice" in r.stderr
    # given a profile running (a server thread is seen inside the sampler), when a second one asks,
    # then it is refused with a sentence and the first one still finishes
    first = {}
    t = threading.Thread(target=lambda: first.setdefault("r", shared_cli(idle.pid, "profile", "--seconds", "6")))
    t.start()
    try:
        seen = poll(
            lambda: "r" in first or "sample_stacks" in shared_cli(idle.pid, "backtrace").stdout, 30, interval=0.05
        )
        assert seen and "r" not in first, "the first profile was never seen sampling"
        r = shared_cli(idle.pid, "profile", "--seconds", "0.2")
        assert r.returncode != 0 and "a profile is already running" in r.stderr, (r.returncode, r.stderr)
    finally:
        t.join(60)
    assert first["r"].returncode == 0, first["r"].stderr


def test_native_profile_through_py_spy(idle, shared_cli):
    r = shared_cli(idle.pid, "profile", "--seconds", "1", "--native")
    if r.returncode != 0 and (why := ptrace_refused()):  # the host's rule, checked apart: not this command's word
        pytest.skip(f"this host refuses ptrace ({why}): {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    assert "main_loop (idle.py:" in r.stdout
