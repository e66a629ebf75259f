"""What the runtime directory and the registry may hold: a directory another user prepared or opened to others, a
planted registry entry, crafted post-mortem records and a pid another process took never break a job nor mislead
the CLI; and a job stopped by SIGTERM leaves no socket or entry behind. Each against a real process."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import needs_root, PROBE_BIN, requires_torch, TARGETS
from harness import clean_env, last_step, other_uid, Recorder, registry_entry, steps_on


def test_sigterm_removes_the_socket_and_registry_entry(spawn, probe_env):
    import os
    import signal

    target = spawn(TARGETS / "idle.py")
    entry = registry_entry(target.pid, probe_env)
    assert os.path.exists(entry["socket"])
    os.kill(target.pid, signal.SIGTERM)
    target.popen.wait(30)
    assert target.popen.returncode == -signal.SIGTERM  # it still dies of SIGTERM, as without the probe
    assert not os.path.exists(entry["socket"])
    assert not os.path.exists(f"{probe_env['PROBE_RUNTIME_DIR']}/{target.pid}.json")


@pytest.mark.parametrize("kind", ["symlink", "open_to_all", "not_a_dir"])
def test_a_prepared_runtime_dir_never_breaks_the_training_script(spawn, cli, tmp_path, kind):
    import os
    import stat

    # given a runtime directory prepared by someone else: a symlink to a directory of ours,
    # a directory anyone can write to, or a plain file in its place
    owned = tmp_path / "victims-own-dir"
    owned.mkdir(mode=0o755)
    os.chmod(owned, 0o755)
    rt = tmp_path / "rt"
    if kind == "symlink":
        rt.symlink_to(owned)
    elif kind == "open_to_all":
        rt.mkdir()
        os.chmod(rt, 0o777)
    else:
        rt.write_text("")
    before = os.lstat(owned).st_mode
    # when the training script starts with the probe
    target = spawn(TARGETS / "idle.py", env={"PROBE_RUNTIME_DIR": str(rt)})
    # then it runs, says once why it used a private directory, and changed nothing it found
    warning = target.wait_for("uses the private directory")
    assert os.lstat(owned).st_mode == before and stat.S_IMODE(before) == 0o755
    if kind == "open_to_all":
        assert stat.S_IMODE(os.lstat(rt).st_mode) == 0o777 and not os.listdir(rt)
    private = warning.split("private directory ", 1)[1].split(" ")[0]
    assert stat.S_IMODE(os.lstat(private).st_mode) == 0o700
    r = cli(target.pid, "query", "SELECT 1 AS ok", "-f", "csv", env={"PROBE_RUNTIME_DIR": private})
    assert r.returncode == 0 and r.stdout.split() == ["ok", "1"], r.stderr
    assert target.popen.poll() is None


ACTIONS = TARGETS / "actions_train.py"


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
    uid = other_uid()
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
    assert steps_on(p, last_step(p))


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
        assert steps_on(p, last_step(p))


@needs_root
def test_the_cli_never_sends_its_token_to_a_planted_entry_nor_lists_it(cli, tmp_path, open_tmp):
    # given a registry another user can write (theirs, or ours with their entry in it) naming their listener
    uid = other_uid()
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
        [sys.executable, "-c", wrapper, PROBE_BIN, "list", "--dead", "--json"],
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


def test_a_pid_taken_by_another_process_is_never_read_as_the_job(spawn, cli, probe_env):

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
