"""Shared fixtures: real target processes and the real `probe` command.

``probe_env`` gives each test its own runtime directory (short, so unix-socket
paths stay under the 108-byte limit). ``spawn`` starts a target script and waits
for its ready line with a deadline (no fixed sleeps); ``cli`` runs the installed
``probe`` console script against it. ``shared_env``, ``shared_spawn`` and
``shared_cli`` are the same for a whole test file: a target that the file's tests
only read is started once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from _procs import stop_groups

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ROOT / "tests" / "targets"
EXAMPLES = ROOT / "examples"
PROBE_BIN = str(Path(sys.executable).with_name("probe")) if Path(sys.executable).with_name("probe").exists() else shutil.which("probe")


def poll(fn, timeout: float = 30.0):
    """Call fn until it returns a truthy value or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)  # ok-sleep: polling with a deadline


def has_torch() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("torch") is not None
    except Exception:
        return False


def _fresh_env(prefix: str = "pr-"):
    """A private runtime dir (short path: unix sockets have a 108-byte limit), no inherited PROBE settings."""
    rt = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE")}
    env["PROBE_RUNTIME_DIR"] = rt
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture
def probe_env():
    """Environment for targets and CLI: a private runtime dir per test."""
    env = _fresh_env()
    yield env
    shutil.rmtree(env["PROBE_RUNTIME_DIR"], ignore_errors=True)


@pytest.fixture(scope="module")
def shared_env():
    """One runtime dir for a whole test file, for targets the file's tests only read."""
    env = _fresh_env("prm-")
    yield env
    shutil.rmtree(env["PROBE_RUNTIME_DIR"], ignore_errors=True)


class Proc:
    def __init__(self, popen: subprocess.Popen, lines: list[str]):
        self.popen = popen
        self.lines = lines
        self.pid = popen.pid

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        """Wait until a line containing ``text`` has been printed; return that line."""
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for line in self.lines[seen:]:
                if text in line:
                    return line
            seen = max(0, len(self.lines) - 1)
            if self.popen.poll() is not None and not any(text in l for l in self.lines):
                raise AssertionError(f"target exited ({self.popen.returncode}) before printing {text!r}:\n{self.output()}")
            time.sleep(0.02)  # ok-sleep: polling with a deadline
        raise AssertionError(f"target did not print {text!r} within {timeout} s:\n{self.output()}")


class Spawner:
    """Start target scripts with ``env``; ``close()`` stops them (SIGCONT, terminate, then kill)."""

    def __init__(self, env: dict):
        self.env = env
        self.procs: list[Proc] = []

    def __call__(self, args, *, env=None, ready: str | None = "ready", timeout: float = 90.0, cwd=None) -> Proc:
        if isinstance(args, (str, Path)):
            args = [str(args)]
        args = [str(a) for a in args]
        if args[0].endswith(".py"):
            args = [sys.executable] + args
        e = dict(self.env)
        e.update(env or {})
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e,
                             cwd=cwd or self.env["PROBE_RUNTIME_DIR"], start_new_session=True)
        lines: list[str] = []

        def pump():
            for line in p.stdout:
                lines.append(line.rstrip("\n"))

        threading.Thread(target=pump, daemon=True).start()
        proc = Proc(p, lines)
        self.procs.append(proc)
        if ready:
            proc.wait_for(ready, timeout)
        return proc

    def close(self) -> None:
        stop_groups([proc.popen for proc in self.procs], grace=5)


@pytest.fixture
def spawn(probe_env):
    spawner = Spawner(probe_env)
    yield spawner
    spawner.close()


@pytest.fixture(scope="module")
def shared_spawn(shared_env):
    """Targets that live for the whole test file (use with ``shared_cli``)."""
    spawner = Spawner(shared_env)
    yield spawner
    spawner.close()


def _cli_runner(base_env: dict):
    # a deadline, not a speed limit: a `probe` call that hangs fails the test, one slowed by a busy host does not
    def _cli(*args, env=None, timeout: float = 180.0, input: str | None = None):
        e = dict(base_env)
        e.update(env or {})
        return subprocess.run([PROBE_BIN, *map(str, args)], capture_output=True, text=True, env=e,
                              timeout=timeout, input=input)

    return _cli


@pytest.fixture
def cli(probe_env):
    """Run the real `probe` command; returns CompletedProcess (text)."""
    return _cli_runner(probe_env)


@pytest.fixture(scope="module")
def shared_cli(shared_env):
    """The real `probe` command in the test file's shared runtime dir."""
    return _cli_runner(shared_env)


requires_torch = pytest.mark.skipif(not has_torch(), reason="torch is not installed")
