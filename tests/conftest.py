"""Shared fixtures over tests/harness.py (the one harness tests and benchmarks share): real target processes and
the real `probe` command.

``probe_env`` gives each test its own runtime directory (short, so unix-socket
paths stay under the 108-byte limit). ``spawn`` starts a target script and waits
for its ready line with a deadline (no fixed sleeps); ``cli`` runs the installed
``probe`` console script against it. ``shared_env``, ``shared_spawn`` and
``shared_cli`` are the same for a whole test file: a target that the file's tests
only read is started once. ``served`` serves probe's agent from the test's own process for the tests of routes,
limits and auth (no process to start); ``agent`` starts a probed process without torch where the test is about
that process (what it imports, that hostile clients leave it stepping).

tests/unit holds the tests that start no process and run in seconds (``pytest tests/unit``); a test
there that starts one fails at once, naming what it started (it belongs beside the integration tests).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from contextlib import ExitStack
from pathlib import Path

import pytest

from harness import EXAMPLES, PROBE_BIN, ROOT, TARGETS, Proc, Spawner, clean_env, poll, run_probe, run_target  # noqa: F401  (re-exported)
from harness import registry_entry, serving, use_fork_server

# The processes the tests start take Ctrl-C (SIGINT) and SIGQUIT as they would from a terminal, also when the run
# was started in the background by a shell without job control, which starts it with both ignored (an ignored
# signal stays ignored across exec; a handled one is reset to the default). Tests that send them rely on it.
for _sig, _handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGQUIT, signal.SIG_DFL)):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, _handler)

# Target scripts that import torch, and the probe command, start as forks of servers that imported torch (or the
# command's modules) once (tests/harness.py, tests/forkserver.py): ~2 s of CPU less per target, ~0.1 s per
# command. PROBE_TEST_FORKSERVER=0 spawns them all.
use_fork_server(os.environ.get("PROBE_TEST_FORKSERVER", "1") != "0")


def has_torch() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("torch") is not None
    except Exception:
        return False


@pytest.fixture
def probe_env():
    """Environment for targets and CLI: a private runtime dir per test."""
    env = clean_env()
    yield env
    shutil.rmtree(env["PROBE_RUNTIME_DIR"], ignore_errors=True)


@pytest.fixture(scope="module")
def shared_env():
    """One runtime dir for a whole test file, for targets the file's tests only read."""
    env = clean_env(prefix="prm-")
    yield env
    shutil.rmtree(env["PROBE_RUNTIME_DIR"], ignore_errors=True)


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


@pytest.fixture
def agent(spawn):
    """Start a probed process without torch (tests/targets/agent.py: ``probe.start()``, then a loop printing
    ``step N``) for the tests about that process under its clients (what it imports, that hostile clients leave it
    stepping; a route, limit or auth alone takes ``served``): ``agent(PROBE_PORT="0", ...)`` starts one with those
    settings and returns its Proc, with its registry entry as ``entry`` (socket, tcp_port, ...). Stopped after the
    test."""

    def start(**settings: str):
        proc = spawn(TARGETS / "agent.py", env=settings)
        proc.entry = registry_entry(proc.pid, spawn.env)
        return proc

    return start


@pytest.fixture
def served(probe_env, tmp_path_factory):
    """probe's agent served from this pytest process on the test's runtime dir (``harness.serving``):
    ``served(PROBE_PORT="0", ...)`` starts it with those settings and returns its ``pid`` (this process's) and
    ``entry``, as ``agent`` does; the ``cli`` fixture reaches it by that pid. Stopped after the test, which fails
    if the stop left a thread, signal handler, atexit entry, hook, setting or file behind."""
    tmp_path_factory.getbasetemp()  # pytest's first temporary directory adds an atexit entry: not the probe's
    with ExitStack() as stack:
        yield lambda **settings: stack.enter_context(serving(probe_env, **settings))


def _cli_runner(base_env: dict):
    def _cli(*args, env=None, timeout: float = 180.0, input: str | None = None):
        return run_probe(*args, env={**base_env, **(env or {})}, timeout=timeout, input=input)

    _cli.env = base_env  # its runtime dir, for helpers that prepare it (tests/_doctor.py)
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
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second local user (setuid)")


UNIT = Path(__file__).resolve().parent / "unit"


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """Under tests/unit, starting a process (subprocess, fork, spawn, system) fails the test."""
    if UNIT not in Path(request.node.path).parents:
        return

    def refused(what):
        def start(*args, **kwargs):
            raise AssertionError(f"a unit test starts no process ({what}); move it out of tests/unit")

        return start

    monkeypatch.setattr(subprocess.Popen, "__init__", refused("subprocess.Popen"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refused(f"os.{name}"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The units pytest-xdist hands out (``--dist loadgroup``, see run-tests): a test file is one unit, so that its
    module-scoped jobs are started once; each case of a test marked ``phases`` (a long run of one job through many
    phases, sharing nothing with the file's other tests) is a unit of its own. Those cases go first, then the files
    with the most tests: a long case dealt out last would end the run alone."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    unit_of, size = {}, {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        own = item.get_closest_marker("phases") is not None
        unit = f"{path}::case{len(unit_of)}" if own else path  # no "]" in a group name: xdist splits at "@"
        unit_of[item] = (own, unit)
        size[unit] = size.get(unit, 0) + 1
        item.add_marker(pytest.mark.xdist_group(unit))
    items.sort(key=lambda item: (not unit_of[item][0], -size[unit_of[item][1]]))  # stable: file order within
