"""Hung processes: py-spy fallback of `probe PID backtrace`, and the in-process hang watchdog."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import TARGETS, poll

from probe.agent.watchdog import LATE_S

pytestmark = pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")


def line_of(target: Path, marker: str) -> int:
    """The line number of the first line of ``target`` holding ``marker`` (a stack names the line a frame is at)."""
    return next(n for n, line in enumerate(target.read_text().splitlines(), 1) if marker in line)


def test_gil_held_in_c_without_probe(spawn, cli):
    # given a main thread inside libc sleep with the GIL held, and no probe
    target = spawn(TARGETS / "hang_gil.py")
    # when
    r = cli(target.pid, "backtrace")
    # then py-spy answers (the probe was never there to ask), says so first, and shows the stuck frame innermost
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("[stacks read by py-spy") and f"process {target.pid} has no probe server" in lines[0]
    assert "holds the GIL" in r.stdout
    frame0 = next(line for line in lines if "#0 " in line)
    assert "stuck_in_c" in frame0 and f"hang_gil.py:{line_of(TARGETS / 'hang_gil.py', '# the stuck frame')}" in frame0


def test_gil_held_with_a_silent_server_falls_back_and_native_shows_the_c_frame(spawn, cli):
    target = spawn(TARGETS / "hang_gil.py", env={"TARGET_WITH_PROBE": "1"})
    r = cli(target.pid, "backtrace", "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["source"] == "py-spy" and "did not answer within 3 s" in doc["note"]
    main = next(t for t in doc["threads"] if t["is_main"])
    assert main["frames"][0]["func"] == "stuck_in_c" and main["frames"][0]["depth"] == 0
    native = cli(target.pid, "backtrace", "--native", "--format", "json")
    assert native.returncode == 0, native.stderr
    frames = next(t for t in json.loads(native.stdout)["threads"] if t["is_main"])["frames"]
    funcs = [f["func"] for f in frames]
    assert frames[0]["native"] is True
    assert "sleep" in funcs[:5]  # libc's sleep, innermost, above the Python frame
    assert funcs.index("stuck_in_c") > funcs.index("sleep")
    assert not frames[funcs.index("stuck_in_c")].get("native")
    text = cli(target.pid, "backtrace", "--native").stdout
    assert "[native]" in text and "because native frames were asked for" in text.splitlines()[0]


def test_blocked_on_queue_and_lock_names_the_lines(spawn, cli):
    target = spawn(TARGETS / "hang_queue.py")
    r = cli(target.pid, "backtrace", "--format", "json")
    assert r.returncode == 0, r.stderr
    threads = json.loads(r.stdout)["threads"]
    main = next(t for t in threads if t["is_main"])
    ours = [f for f in main["frames"] if f["file"].endswith("hang_queue.py")]
    assert ours[0]["func"] == "wait_for_job" and "jobs.get()" in ours[0]["line"]
    files = [f["file"] for f in main["frames"]]
    assert files[0].endswith("threading.py") and main["frames"][0]["func"].endswith("wait")  # innermost: Condition.wait
    assert any(f.endswith("queue.py") for f in files[: files.index(ours[0]["file"])])  # inside Queue.get
    waiter = next(t for t in threads if t["name"] == "lock-waiter")
    assert [f for f in waiter["frames"] if f["file"].endswith("hang_queue.py")][0]["line"].startswith("with lock:")
    one = cli(target.pid, "backtrace", "--thread", "lock-waiter", "--format", "json")
    assert [t["name"] for t in json.loads(one.stdout)["threads"]] == ["lock-waiter"]


def _wait_file(path: Path, text: str, deadline_s: float) -> str:
    got = poll(lambda: path.exists() and text in (dump := path.read_text()) and dump, deadline_s, interval=0.05)
    assert got, f"{path} did not get {text!r} within {deadline_s} s"
    return got


@pytest.mark.parametrize("mode", ["gil", "sleep"])
def test_watchdog_writes_stacks_and_reports_hung(spawn, cli, probe_env, mode):
    timeout_s = 1.0
    target = spawn([TARGETS / "hang_steps.py", mode], env={"PROBE_HANG_TIMEOUT": str(timeout_s)})
    ready_at = time.time()  # after the target's last step: it prints ready once its steps are done
    dump = Path(probe_env["PROBE_RUNTIME_DIR"]) / f"hang-{target.pid}.txt"
    text = _wait_file(dump, "stuck_after_steps", 60)  # a deadline: the watchdog fires 1 s after the last step
    stuck = line_of(TARGETS / "hang_steps.py", "# stuck in C" if mode == "gil" else "# ok-sleep: stuck")
    assert "hang_steps.py" in text and f"line {stuck}" in text
    assert stat_mode(dump) == 0o600
    if mode == "sleep":  # the server can answer: probe list and process.info say hung since the last step
        listed = json.loads(cli("list", "--json").stdout)[0]
        assert listed["state"] == "hung" and listed["hung_since"] <= ready_at + 0.5
        q = cli(target.pid, "query", "SELECT state, hung_since FROM process.info", "--format", "json")
        row = json.loads(q.stdout)[0]
        assert row["state"] == "hung" and row["hung_since"] is not None


def stat_mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o777


def test_watchdog_stays_quiet_while_steps_complete(spawn, cli, probe_env):
    # a target that keeps stepping (every 50 ms, for longer than the timeout, until told to stop) gets no dump and
    # is not called hung, as long as no gap between its steps (or from arming to the first) reached the timeout
    # (it may fire up to LATE_S later: it is re-armed from heartbeats, not at every step):
    # the target reports its longest gap when it stops (a loaded host can stretch one past it: then a dump is right)
    timeout_s = 2.0
    stop = Path(probe_env["PROBE_RUNTIME_DIR"]) / "stop"
    script = (
        "import os, time\nt = time.monotonic()\nimport probe.auto\n"
        "from probe.training import boundary\n"
        "print('ready', os.getpid(), flush=True)\ngap, i = 0.0, 0\n"
        f"while not os.path.exists({str(stop)!r}):\n"
        "    now = time.monotonic(); gap = max(gap, now - t); t = now\n"
        "    boundary.passed(i); i += 1\n"
        "    if i == 60: print('stepped 60', flush=True)\n"
        "    time.sleep(0.05)\n"  # ok-sleep: target code
        "print(f'done gap={gap:.3f}', flush=True)\ntime.sleep(60)\n"  # ok-sleep: target code
    )
    path = Path(probe_env["PROBE_RUNTIME_DIR"]) / "stepping.py"
    path.write_text(script)
    target = spawn(path, env={"PROBE_HANG_TIMEOUT": str(timeout_s)})
    target.wait_for("stepped 60", 120)  # 3 s of steps at least: past the timeout
    dump = Path(probe_env["PROBE_RUNTIME_DIR"]) / f"hang-{target.pid}.txt"
    size = dump.stat().st_size
    state = json.loads(cli("list", "--json").stdout)[0]["state"]
    stop.touch()
    gap = float(target.wait_for("done", 120).split("=")[1])
    if gap < timeout_s - 0.2:  # (the first gap runs from before the import that armed it: an upper bound)
        assert size == 0, dump.read_text()
        assert state != "hung"
    elif gap > timeout_s + LATE_S + 0.5:  # a step came that late: the watchdog fired in between
        assert "stepping.py" in dump.read_text()


def _main_liveness(cli, pid) -> dict:
    q = cli(
        pid, "query", "SELECT executing, unchanged_s, state, func FROM python.threads WHERE is_main", "--format", "json"
    )
    assert q.returncode == 0, q.stderr
    return json.loads(q.stdout)[0]


def test_liveness_tells_python_from_a_c_call(spawn, cli):
    # a main thread spinning in Python moves between the two samples of one query
    spinning = spawn(TARGETS / "plain_spin.py")
    row = _main_liveness(cli, spinning.pid)
    assert row["executing"] is True and row["unchanged_s"] == 0 and row["func"] == "spin"
    # a main thread waiting in one C call (time.sleep, GIL released) does not, and the wait accumulates
    # (the second answer's wait is longer than the first's: an order, whatever the time between the two)
    waiting = spawn([TARGETS / "hang_steps.py", "sleep"])
    first = _main_liveness(cli, waiting.pid)
    second = _main_liveness(cli, waiting.pid)
    assert first["executing"] is False and second["executing"] is False
    assert first["func"] == second["func"] == "stuck_after_steps"
    assert second["unchanged_s"] > first["unchanged_s"] > 0


def test_list_shows_a_gil_held_rank_as_hung_from_its_dump(spawn, cli, probe_env):
    # the server cannot answer (GIL held in C), so `probe list` reads the watchdog's dump instead
    started_at = time.time()
    target = spawn([TARGETS / "hang_steps.py", "gil"], env={"PROBE_HANG_TIMEOUT": "1"})
    ready_at = time.time()
    _wait_file(Path(probe_env["PROBE_RUNTIME_DIR"]) / f"hang-{target.pid}.txt", "stuck_after_steps", 60)
    row = json.loads(cli("list", "--json").stdout)[0]
    assert row["pid"] == target.pid and row["state"] == "hung"
    # hung since its last step, not since the watchdog fired (a timeout, 1 s, later). Offline, the CLI has only the
    # dump file's mtime (the kernel's coarse clock) minus faulthandler's timeout, and the timer itself runs on a third
    # clock: half the timeout either side of the window separates the last step from the firing at any machine speed
    assert started_at - 0.5 <= row["hung_since"] <= ready_at + 0.5
