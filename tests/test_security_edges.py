"""Who runs what, what a rate may be, what a shared registry may hold, and the edges of checkpoint paths and
injection, each against a real process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROBE_BIN as PROBE_BIN_PATH, TARGETS, poll, requires_torch
from harness import Recorder, clean_env, last_step, post

PLAIN = TARGETS / "plain_loop.py"
ACTIONS = TARGETS / "actions_train.py"


# -- item 1: probe never runs a file the target's owner controls ------------------------------------------


def _swap_for_script(path: Path, marker: Path) -> None:
    """What the target's owner can do after start: put a script where the running binary was."""
    path.unlink()
    path.write_text(f"#!/bin/sh\ntouch {marker}\nexec sleep 100\n")
    path.chmod(0o755)


def test_a_binary_named_python_is_never_run_to_learn_its_version(spawn, cli, tmp_path):
    # given a copy of `sleep` named `python` (no libpython, no version in its name), replaced on disk by a
    # script after it started, as the process's owner could
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "python"
    shutil.copy2(shutil.which("sleep"), fake)
    target = spawn([str(fake), "100"], ready=None)
    poll(lambda: os.readlink(f"/proc/{target.pid}/exe").startswith(str(fake)))
    marker = tmp_path / "ran-as-prober"
    _swap_for_script(fake, marker)
    # when root (or any user) asks for its stacks and tries to inject
    bt = cli(target.pid, "backtrace")
    inj = cli("inject", target.pid)
    # then nothing ran the file, and each command says why in one sentence
    assert not marker.exists(), "probe executed the target's executable"
    for r in (bt, inj):
        assert r.returncode == 11, r.stdout + r.stderr
        assert "never runs a target's executable" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert target.popen.poll() is None


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3.11"), reason="no statically linked /usr/bin/python3.11 here")
def test_a_static_python_without_version_in_its_name_is_recognised_from_its_symbols(spawn, cli, tmp_path):
    # given Debian's static interpreter (no libpython) copied under the bare name `python`
    exe = tmp_path / "python"
    shutil.copy2("/usr/bin/python3.11", exe)
    code = "import time\ndef wait_here():\n    time.sleep(100)\nprint('ready', flush=True)\nwait_here()\n"  # ok-sleep
    target = spawn([str(exe), "-S", "-c", code])
    # when / then its version is read from its Py_Version symbol and py-spy reads its stacks
    r = cli(target.pid, "backtrace")
    assert "not a Python process" not in r.stderr and "never runs" not in r.stderr, r.stderr
    assert r.returncode == 0 and "wait_here" in r.stdout, r.stdout + r.stderr


# -- item 2: a learning rate no step could use (or that cannot train) is refused before anything is queued --


def _steps_on(proc, after: int) -> bool:
    return bool(poll(lambda: proc.popen.poll() is None and last_step(proc) > after + 2, timeout=60))


def _lr_actions(cli, pid) -> list:
    r = cli(pid, "query", "SELECT id, state FROM probe.actions WHERE command = 'lr'", "--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _audit(env) -> list:
    """The audit log's lines ([] before the first action wrote one)."""
    try:
        with open(os.path.join(env["PROBE_RUNTIME_DIR"], "audit.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


@pytest.fixture(scope="module")
def rate_jobs(shared_spawn):
    """One training job per optimizer and dtype (no scheduler: the rate stays 0.05), shared by the refusals: a
    refused rate queues nothing and changes nothing, so each case meets the job as the first one did."""
    jobs: dict = {}

    def job(optim: str, dtype: str):
        if (optim, dtype) not in jobs:
            jobs[optim, dtype] = shared_spawn(
                [ACTIONS, "--sched", "none", "--optim", optim, "--dtype", dtype, "--step-sleep", "0.05"]
            )
        return jobs[optim, dtype]

    return job


@requires_torch
@pytest.mark.parametrize(
    "optim, dtype, argv, words",
    [
        ("Adam", "float32", ["--set", "1e39"], "would overflow its float32 parameters"),
        ("Adam", "float32", ["--set", "1e39", "--force"], "would overflow its float32 parameters"),
        ("SGD", "float32", ["--scale", "1e308"], "would overflow its float32 parameters"),
        ("SGD", "float32", ["--scale", "1e308", "--force"], "would overflow its float32 parameters"),
        ("Adam", "float16", ["--set", "100", "--force"], "would overflow its float16 parameters"),
        ("SGD", "float32", ["--set", "nan"], "must be a finite number"),
        ("SGD", "float32", ["--scale", "inf"], "must be a finite number"),
        ("SGD", "float32", ["--set", "0"], "give --allow-zero"),
        ("SGD", "float32", ["--scale", "0"], "give --allow-zero"),
        ("SGD", "float32", ["--set", "-0.1"], "must not be negative"),
        ("SGD", "float32", ["--set", "5"], "give --force if you mean it"),
    ],
)
def test_a_rate_that_would_kill_or_stall_the_job_is_refused_and_nothing_is_queued(
    rate_jobs, shared_cli, shared_env, optim, dtype, argv, words
):
    # given a training job (no scheduler: the rate stays 0.05), and the audit log so far
    p = rate_jobs(optim, dtype)
    audited = len(_audit(shared_env))
    # when the CLI asks for the rate
    r = shared_cli(p.pid, "--yes", "lr", *argv)
    # then one sentence, a non-zero exit, nothing queued, a refusal in the audit log, and the job steps on
    assert r.returncode != 0, r.stdout + r.stderr
    assert words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert _lr_actions(shared_cli, p.pid) == []
    refused = [a for a in _audit(shared_env)[audited:] if a.get("command") == "lr"]
    assert refused and all(a.get("outcome") == "refused" and a.get("pid") in (p.pid, None) for a in refused), refused
    assert _steps_on(p, last_step(p)), p.output()[-2000:]


@requires_torch
def test_asked_for_a_zero_or_a_big_jump_is_applied_and_the_job_steps_on(spawn, cli):
    p = spawn([ACTIONS, "--sched", "none", "--step-sleep", "0.05"])
    r = cli(p.pid, "--yes", "lr", "--set", "2", "--force")
    assert r.returncode == 0 and "0.05 -> 2" in r.stdout, r.stdout + r.stderr
    r = cli(p.pid, "--yes", "lr", "--set", "0", "--allow-zero")
    assert r.returncode == 0 and "2 -> 0" in r.stdout, r.stdout + r.stderr
    assert poll(lambda: any(line.startswith("step ") for line in p.lines)) and _steps_on(p, last_step(p))


@requires_torch
def test_the_http_route_refuses_the_same_rates(spawn, cli, probe_env):
    # given the route every tier reaches (the page, MCP and TCP post the same body)
    p = spawn([ACTIONS, "--sched", "none", "--optim", "Adam", "--step-sleep", "0.05"])
    with open(f"{probe_env['PROBE_RUNTIME_DIR']}/{p.pid}.json") as f:
        sock = json.load(f)["socket"]

    for body, words in (
        ({"set": 1e39, "force": True}, "would overflow"),
        ({"scale": 1e308}, "would overflow"),
        ({"set": 0.0}, "--allow-zero"),
        ({"set": 1.0}, "--force"),
        ({"set": "NaN"}, "finite"),
    ):
        status, doc = post(sock, "/actions/lr", json.dumps(body).encode())
        assert 400 <= status < 500 and words in json.dumps(doc), (body, status, doc)
    assert _lr_actions(cli, p.pid) == []
    assert _steps_on(p, last_step(p))


# -- item 3: a shared registry is used only when no one else could have written it --------------------------


def _other_uid() -> int:
    """A uid no account uses: the other local user (root can become any uid without an account)."""
    import pwd

    used = {p.pw_uid for p in pwd.getpwall()}
    return next(u for u in range(47000, 60000) if u not in used)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second local user (setuid)")


def _as_other(uid: int, script: str) -> None:
    """Run a shell ``script`` as the other local user."""
    subprocess.run(
        ["/bin/sh", "-c", script],
        check=True,
        preexec_fn=lambda: (os.setgid(uid), os.setuid(uid)),
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
        timeout=60,
    )


@pytest.fixture
def open_tmp():
    """A folder like /tmp (world-writable, sticky) where the other user can create theirs (pytest's tmp_path sits
    in a 0700 folder of ours)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="pr-reg-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _planted_registry(base: Path, uid: int) -> Path:
    """What the other user prepares: a world-writable registry holding a token of theirs."""
    reg = base / "registry"
    _as_other(uid, f"mkdir -m 777 '{reg}' && printf planted-token > '{reg}/token'")
    return reg


def _errors(cli, pid) -> list:
    r = cli(pid, "query", "SELECT source, message FROM probe.errors", "--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@needs_root
@requires_torch
def test_a_registry_another_user_prepared_is_refused_and_the_job_trains_on(spawn, cli, open_tmp, probe_env):
    # given a registry directory another user created (mode 0777, their token inside)
    uid = _other_uid()
    reg = _planted_registry(open_tmp, uid)
    # when a job starts with PROBE_REGISTRY pointing there
    p = spawn(
        [ACTIONS, "--sched", "none", "--step-sleep", "0.05"],
        env={"PROBE_REGISTRY": str(reg), "RANK": "0", "WORLD_SIZE": "1"},
    )
    # then it says why once, writes nothing there, listens on no TCP port with the planted token, and trains on
    said = [line for line in p.lines if "shared registry" in line]
    assert len(said) == 1 and "belongs to another user" in said[0] and "goes on without" in said[0], p.output()
    assert sorted(os.listdir(reg)) == ["token"]
    entry = json.loads(Path(probe_env["PROBE_RUNTIME_DIR"], f"{p.pid}.json").read_text())
    assert entry.get("tcp_port") is None and entry.get("token") != "planted-token", entry
    assert any(
        "shared registry" in e["source"] and "belongs to another user" in e["message"] for e in _errors(cli, p.pid)
    )
    assert _steps_on(p, last_step(p))


@requires_torch
def test_a_registry_open_to_others_or_holding_a_symlink_is_refused_even_when_it_is_ours(spawn, cli, tmp_path):
    # given one registry of ours open to everyone, and one private but with a planted symlink
    open_reg = tmp_path / "open"
    open_reg.mkdir()
    open_reg.chmod(0o777)
    linked = tmp_path / "linked"
    linked.mkdir(mode=0o700)
    (linked / f"{os.uname().nodename}-{os.getpid()}.json").symlink_to(tmp_path / "somewhere-the-planter-reads")
    for reg, words in ((open_reg, "is open to other users"), (linked, "a symbolic link")):
        # when a job starts with it
        p = spawn([ACTIONS, "--sched", "none", "--step-sleep", "0.05"], env={"PROBE_REGISTRY": str(reg)})
        # then it is refused with one sentence, and the job trains on
        said = [line for line in p.lines if "shared registry" in line]
        assert len(said) == 1 and words in said[0], p.output()
        assert not (tmp_path / "somewhere-the-planter-reads").exists()
        assert not [n for n in os.listdir(reg) if n.endswith(".json") and not os.path.islink(reg / n)]
        assert _steps_on(p, last_step(p))


@needs_root
def test_the_cli_never_sends_its_token_to_a_planted_entry_nor_lists_it(cli, tmp_path, open_tmp):
    # given a registry another user can write (theirs, or ours with their entry in it) naming their listener
    uid = _other_uid()
    listener = Recorder()  # the planter's fake rank
    fake = {
        "pid": 4242,
        "rank": 0,
        "world_size": 1,
        "job": "j",
        "host": "node-x",
        "tcp_host": "127.0.0.1",
        "tcp_port": listener.port,
        "started_at": 1.0,
        "shared": True,
    }
    theirs = _planted_registry(open_tmp, uid)
    _as_other(uid, f"printf '%s' '{json.dumps(fake)}' > '{theirs}/node-x-4242.json'")
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    (ours / "node-x-4242.json").write_text(json.dumps(fake))
    os.chown(ours / "node-x-4242.json", uid, uid)
    for reg in (theirs, ours):
        env = {"PROBE_REGISTRY": str(reg), "PROBE_TOKEN": "the-owners-secret"}
        # when the owner asks every rank, and lists the processes
        r = cli("--ranks", "all", "status", env=env)
        listed = cli("list", "--json", env=env)
        # then nothing reached the listener, the fake is not listed, and the refusal is said once
        assert listener.got == [], listener.got
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.count("goes on without the shared registry") == 1, r.stderr
        assert listed.returncode == 0 and 4242 not in [e.get("pid") for e in json.loads(listed.stdout or "[]")]


def _record(base: Path, name: str, meta: dict, npz: bytes | None = None) -> None:
    folder = base / "postmortem" / name
    folder.mkdir(parents=True, mode=0o700)
    (folder / "meta.json").write_text(json.dumps(meta))
    if npz is not None:
        (folder / "tables.npz").write_bytes(npz)
    for p in (folder, folder / "meta.json", folder / "tables.npz"):
        if p.exists():
            p.chmod(0o700 if p.is_dir() else 0o600)


def _bomb(rows: int) -> bytes:
    """A tables.npz whose torch.steps/step member is ``rows`` float64 zeros, deflated (~1000x smaller)."""
    import io
    import zipfile

    import numpy as np

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (rows,)})
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("torch.steps/step.npy", "w", force_zip64=True) as m:
            m.write(header.getvalue())
            chunk = bytes(1 << 20)
            for _ in range(rows * 8 >> 20):
                m.write(chunk)
    return out.getvalue()


def test_crafted_post_mortem_records_cannot_crash_or_bloat_probe_list_dead(cli, tmp_path):
    # given a registry of ours holding crafted records of "another node"
    reg = tmp_path / "registry"
    reg.mkdir(mode=0o700)
    (reg / "postmortem").mkdir(mode=0o700)
    good = {
        "pid": 11,
        "cause": "exception",
        "time": 1.7e9,
        "host": "node-x",
        "rank": 0,
        "job": "j",
        "exception": {"type": "RuntimeError", "message": "boom", "traceback": ""},
        "tables": ["torch.steps"],
    }
    _record(reg, "node-x-11", dict(good))
    _record(reg, "node-x-12", dict(good, pid="12"))  # wrong type
    _record(reg, "node-x-13", {k: v for k, v in good.items() if k != "cause"})  # missing key
    _record(reg, "node-x-14", dict(good, pid=14, time="yesterday"))
    _record(reg, "node-x-15", dict(good, pid=15, thread_deaths=[{"thread": "t"}], stacks="x"))
    _record(reg, "node-x-16", dict(good, pid=16, time=1e300))
    bomb = _bomb(400 << 17)  # 400 MiB of float64 zeros in a few hundred KB
    assert len(bomb) < 2 << 20
    _record(reg, "node-x-17", dict(good, pid=17), npz=bomb)
    # when the CLI lists the dead (its peak memory measured from the kernel's accounting of that one child)
    env = clean_env(str(tmp_path / "rt"), PROBE_REGISTRY=str(reg))
    wrapper = (
        "import resource, subprocess, sys\n"
        "r = subprocess.run(sys.argv[1:])\n"
        "print('maxrss_kib=%d' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
        "sys.exit(r.returncode)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, PROBE_BIN_PATH, "list", "--dead", "--json"],
        capture_output=True,
        env=env,
        text=True,
        timeout=120,
    )
    out, err = proc.stdout, proc.stderr
    peak_kib = int(err.rpartition("maxrss_kib=")[2])
    # then it lists the sane records, skips the crafted ones, and never holds the bomb in memory
    assert proc.returncode == 0 and "Traceback" not in err, err
    pids = sorted(r["pid"] for r in json.loads(out))
    assert pids == [11, 17], out
    assert [r["last_step"] for r in json.loads(out) if r["pid"] == 17] == [None]
    assert peak_kib < 300 << 10, err  # the bomb alone is 400 MiB


# -- item 8: a checkpoint path that is not text, and inject into another user's process ---------------------


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
        [os.fsencode(PROBE_BIN_PATH), str(p.pid).encode(), b"checkpoint", os.fsencode(str(tmp_path)) + b"/b\xff.pt"],
        capture_output=True,
        text=True,
        env=probe_env,
        timeout=60,
    )
    assert r.returncode != 0 and "not UTF-8 text" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert os.listdir(tmp_path) == []
    refused = [a for a in _audit(probe_env) if a.get("command") == "checkpoint"]
    assert len(refused) == 2 and all(a["outcome"] == "refused" for a in refused), refused
    assert _steps_on(p, last_step(p))


@needs_root
@pytest.mark.skipif(not os.path.exists("/usr/bin/python3.11"), reason="no system Python another user can run")
def test_root_inject_into_another_users_python_says_why_at_once(cli):
    uid = _other_uid()
    code = "import time\ndef waiting():\n    time.sleep(300)\nprint('ready', flush=True)\nwaiting()\n"  # ok-sleep
    target = subprocess.Popen(
        ["/usr/bin/python3.11", "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        start_new_session=True,
        preexec_fn=lambda: (os.setgid(uid), os.setuid(uid)),
    )
    try:
        assert target.stdout.readline().strip() == "ready"
        r = cli("inject", target.pid)
        assert r.returncode == 12, r.stdout + r.stderr
        assert f"belongs to uid {uid}" in r.stderr and f"sudo -u '#{uid}' probe inject {target.pid}" in r.stderr, (
            r.stderr
        )
        assert "bytecode boundary" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert target.poll() is None
    finally:
        target.kill()
        target.wait()


# -- a pid the kernel gave to another process ------------------------------------------------------------


def test_a_pid_taken_by_another_process_is_never_read_as_the_job(spawn, cli, probe_env):
    import socket

    # given a registry entry (and a socket nobody listens on) left by a job that died, whose pid another, unprobed
    # process now has: it started at another time than the entry says
    other = spawn(TARGETS / "idle.py", env={"TARGET_NO_PROBE": "1"})
    rdir = Path(probe_env["PROBE_RUNTIME_DIR"])
    sock_path = str(rdir / f"{other.pid}.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(sock_path)  # closed without listening: connecting is refused, as with a killed job's socket
    entry = {"pid": other.pid, "host": socket.gethostname(), "socket": sock_path, "started_at": 1.0}
    began = int(Path(f"/proc/{other.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # clock ticks since boot
    (rdir / f"{other.pid}.json").write_text(json.dumps(dict(entry, proc_start=began - 100)))
    (rdir / f"{other.pid}.json").chmod(0o600)

    # when the owner asks for the job's stacks by its pid
    r = cli(other.pid, "backtrace")

    # then one sentence says the pid is another process now, and nothing of that process is printed as the job's
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert f"pid {other.pid} is now another process (started " in r.stderr and "is gone" in r.stderr, r.stderr
    assert "data-worker" not in r.stdout, r.stdout
    # and probe list does not list it
    assert other.pid not in [row["pid"] for row in json.loads(cli("list", "--json").stdout)]
