"""Which processes `probe inject` takes for Python: a binary merely named python is never run to learn its version, a
static Python is recognised from its symbols, and root injecting into another user's Python is told why at once."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import needs_root, poll
from harness import other_uid


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


@needs_root
@pytest.mark.skipif(not os.path.exists("/usr/bin/python3.11"), reason="no system Python another user can run")
def test_root_inject_into_another_users_python_says_why_at_once(cli):
    uid = other_uid()
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
