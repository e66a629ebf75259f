"""The guards around the actions, against real training processes: `debug` needs the eval tier, `checkpoint` refuses
special files, links and paths that are not text (with an audit line), and evals are answered and can be cancelled."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import poll, PROBE_BIN, requires_torch, TARGETS
from harness import audit_records, last_step, post, start, steps_on


def test_debug_needs_the_eval_tier(spawn, cli):
    target = spawn(TARGETS / "idle.py", env={"PROBE_ALLOW_EVAL": "0"})
    r = cli(target.pid, "debug", "--port", "0")
    assert r.returncode == 4 and "PROBE_ALLOW_EVAL=0" in r.stderr, r.stdout + r.stderr


@requires_torch
def test_checkpoint_refuses_special_files_and_links_and_sweeps_only_its_dead_temps(spawn, cli, tmp_path):
    import os

    target = spawn(TARGETS / "actions_train.py")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "link.pt").symlink_to(victim)
    for path, fragment in (("/dev/null", "not a regular file"), (str(tmp_path / "link.pt"), "symbolic link")):
        r = cli(target.pid, "--yes", "checkpoint", path, "--force")
        assert r.returncode != 0 and fragment in (r.stdout + r.stderr), r.stdout + r.stderr
    assert os.path.isfile(victim) and victim.read_text() == "keep me"
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    # temp files left by a writer that was killed (its pid is gone) are swept by the next checkpoint there; a file
    # only named like one (another user's, a link, a live writer's, a name the writer never uses) stays
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [
        tmp_path / f".ck.pt.0123456789abcdef.{dead.pid}.tmp",
        tmp_path / f".ck.pt.sha256.fedcba9876543210.{dead.pid}.tmp",
    ]
    kept = [
        tmp_path / f".ck.pt.tmp-{dead.pid}",
        tmp_path / f".ck.pt.0123456789abcdef.{target.pid}.tmp",
        tmp_path / f".ck.pt.0123456789abcdeX.{dead.pid}.tmp",
    ]
    for path in stale + kept:
        path.write_bytes(b"half a checkpoint")
    kept.append(tmp_path / f".ck.pt.aaaaaaaaaaaaaaaa.{dead.pid}.tmp")
    kept[-1].symlink_to(victim)
    if os.geteuid() == 0:
        kept.append(tmp_path / f".ck.pt.bbbbbbbbbbbbbbbb.{dead.pid}.tmp")
        kept[-1].write_bytes(b"theirs")
        os.chown(kept[-1], 47123, 47123)
    r = cli(target.pid, "--yes", "checkpoint", str(tmp_path / "ck.pt"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not any(p.exists() for p in stale) and (tmp_path / "ck.pt").is_file()
    assert all(os.path.lexists(p) for p in kept) and victim.read_text() == "keep me"


def _action_id(cli, pid, code_fragment: str) -> int:
    def running() -> list:
        rows = json.loads(
            cli(pid, "query", "SELECT id, state, args FROM probe.actions WHERE command = 'eval'", "-f", "json").stdout
        )
        return [row["id"] for row in rows if row["state"] == "running" and code_fragment in row["args"]]

    ids = poll(running, 30, interval=0.05)
    assert ids, "the eval never showed up as running"
    return ids[0]


def test_evals_are_answered_and_can_be_cancelled(spawn, cli, probe_env):
    import signal

    target = spawn(TARGETS / "idle.py")
    # KeyboardInterrupt raised by the code is an answer, not a silent connection and a traceback
    r = cli(target.pid, "eval", "raise KeyboardInterrupt")
    assert r.returncode != 0 and "KeyboardInterrupt" in r.stdout + r.stderr, r.stdout + r.stderr
    # an eval that never returns is cancelled by id ...
    looping = subprocess.Popen(
        [PROBE_BIN, str(target.pid), "eval", "n = 0\nwhile True: n += 1  # first"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=probe_env,
    )
    action = _action_id(cli, target.pid, "# first")
    r = cli(target.pid, "cancel", action)
    assert r.returncode == 0, r.stderr
    out, err = looping.communicate(timeout=30)
    assert looping.returncode != 0 and "cancelled" in out + err, out + err
    # ... or by Ctrl-C in the CLI that started it
    # (once the CLI holds the id: it says so itself, "action N running for 5 s", from inside its wait loop)
    looping = start(
        [PROBE_BIN, target.pid, "eval", "n = 0\nwhile True: n += 1  # second"],
        probe_env,
        ready=" running for ",
        timeout=60,
    )
    second = _action_id(cli, target.pid, "# second")
    looping.popen.send_signal(signal.SIGINT)
    looping.popen.wait(30)
    looping.wait_line(lambda line: "interrupted" in line, "'interrupted'", timeout=30)
    assert looping.popen.returncode == 130, looping.output()
    states = dict(
        (row["id"], row["state"])
        for row in json.loads(cli(target.pid, "query", "SELECT id, state FROM probe.actions", "-f", "json").stdout)
    )
    assert states[action] == "cancelled" and states[second] == "cancelled", states
    # and the process is healthy, with no traceback on its stderr
    assert cli(target.pid, "query", "SELECT 1 AS ok", "-f", "csv").returncode == 0
    assert "Traceback" not in target.output(), target.output()


ACTIONS = TARGETS / "actions_train.py"


@requires_torch
def test_a_checkpoint_path_that_is_not_text_gets_a_sentence_and_an_audit_line(spawn, cli, probe_env, tmp_path):
    p = spawn([ACTIONS, "--sched", "none", "--step-sleep", "0.05"])
    with open(f"{probe_env['PROBE_RUNTIME_DIR']}/{p.pid}.json") as f:
        sock = json.load(f)["socket"]

    # a lone surrogate sent as JSON (what a client can send over any tier)
    status, doc = post(sock, "/actions/checkpoint", json.dumps({"path": str(tmp_path / "a\ud800.pt")}).encode())
    assert 400 <= status < 500 and "not UTF-8 text at position" in doc.get("error", ""), (status, doc)
    # a byte the shell passes undecoded (the CLI sees it as \udcff)
    r = subprocess.run(
        [os.fsencode(PROBE_BIN), str(p.pid).encode(), b"checkpoint", os.fsencode(str(tmp_path)) + b"/b\xff.pt"],
        capture_output=True,
        text=True,
        env=probe_env,
        timeout=60,
    )
    assert r.returncode != 0 and "not UTF-8 text" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert os.listdir(tmp_path) == []
    refused = [a for a in audit_records(probe_env) if a.get("command") == "checkpoint"]
    assert len(refused) == 2 and all(a["outcome"] == "refused" for a in refused), refused
    assert steps_on(p, last_step(p))
