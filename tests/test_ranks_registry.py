"""Discovery across nodes through a shared registry directory (PROBE_REGISTRY).

Each "node" gets its own runtime directory, and the ranks' unix sockets are removed
after start, so the CLI (with a third runtime directory) can only reach them the way
it would reach another node: through the shared registry, over TCP, with the job token.
"""

from __future__ import annotations

import json
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from conftest import TARGETS


@pytest.fixture
def dirs():
    made = {name: tempfile.mkdtemp(prefix=f"pr{name}-", dir="/tmp") for name in ("shared", "a", "b", "cli")}
    yield made
    for d in made.values():
        shutil.rmtree(d, ignore_errors=True)


def test_ranks_found_through_the_shared_registry_over_tcp(spawn, cli, dirs):
    # given: two ranks on two "nodes" writing to one shared registry
    procs = {}
    for rank, node in ((0, "a"), (1, "b")):
        procs[rank] = spawn(
            TARGETS / "idle.py",
            env={
                "PROBE_RUNTIME_DIR": dirs[node],
                "PROBE_REGISTRY": dirs["shared"],
                "PROBE_HOST": "127.0.0.1",
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
            },
        )
    for node in ("a", "b"):
        for sock in Path(dirs[node]).glob("*.sock"):
            sock.unlink()  # from the CLI's point of view these ranks are on other hosts
    token_file = Path(dirs["shared"]) / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    entries = sorted(Path(dirs["shared"]).glob("*.json"))
    assert len(entries) == 2 and all(stat.S_IMODE(e.stat().st_mode) == 0o600 for e in entries)
    assert {json.loads(e.read_text())["tcp_port"] is not None for e in entries} == {True}

    # when: the CLI, with a runtime directory of its own, asks every rank
    env = {"PROBE_RUNTIME_DIR": dirs["cli"], "PROBE_REGISTRY": dirs["shared"]}
    r = cli(
        "--ranks", "all", "query", "SELECT rank, pid, world_size FROM process.info ORDER BY rank", "-f", "json", env=env
    )

    # then: both ranks answer over TCP with the job's token
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(row["rank"], row["pid"]) for row in rows] == [(0, procs[0].pid), (1, procs[1].pid)]
    one = cli("--rank", "1", "query", "SELECT tcp_port IS NOT NULL AS tcp FROM process.info", "-f", "json", env=env)
    assert json.loads(one.stdout) == [{"tcp": True}], one.stderr

    # and without the shared registry the CLI finds nobody, and says how to fix it
    alone = cli("--ranks", "all", "query", "SELECT 1", env={"PROBE_RUNTIME_DIR": dirs["cli"]})
    assert alone.returncode == 3 and "PROBE_REGISTRY" in alone.stderr


def _listening(pid: int, port: int) -> set[str]:
    """The IPv4 addresses process ``pid`` listens on at ``port``, read from its /proc/<pid>/net/tcp."""
    found = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hexport = local.split(":")
        if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(addr))))
    return found


def test_a_rank_in_a_shared_registry_binds_loopback_unless_probe_host_opens_it(spawn, dirs):
    # given: a rank that writes to a shared registry, with PROBE_HOST unset
    env = {
        "PROBE_RUNTIME_DIR": dirs["a"],
        "PROBE_REGISTRY": dirs["shared"],
        "RANK": "0",
        "WORLD_SIZE": "1",
        "PROBE_HOST": "",
    }  # blank is unset (and overrides one exported where the tests run)
    proc = spawn(TARGETS / "idle.py", env=env)

    # then: its TCP listener is on 127.0.0.1, as PROBE_HOST's declared default says, and its entry says so
    entry = json.loads(next(Path(dirs["shared"]).glob("*.json")).read_text())
    assert entry["tcp_host"] == "127.0.0.1" and entry["tcp_port"]
    assert _listening(proc.pid, entry["tcp_port"]) == {"127.0.0.1"}


def test_a_loopback_rank_on_another_node_gets_a_sentence_not_a_connection(cli, dirs):
    # given: a shared registry naming a rank on another node that listens on its loopback only
    fake = {
        "pid": 4242,
        "rank": 0,
        "world_size": 1,
        "job": "j",
        "host": "node-elsewhere",
        "tcp_host": "127.0.0.1",
        "tcp_port": 1,
        "started_at": 1.0,
        "shared": True,
    }
    entry = Path(dirs["shared"]) / "node-elsewhere-4242.json"
    entry.write_text(json.dumps(fake))
    entry.chmod(0o600)

    # when: the CLI asks that rank
    r = cli(
        "--rank", "0", "query", "SELECT 1", env={"PROBE_RUNTIME_DIR": dirs["cli"], "PROBE_REGISTRY": dirs["shared"]}
    )

    # then: one sentence that names the fix, no traceback, no connection to this host's port 1
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "loopback only" in r.stderr and "PROBE_HOST" in r.stderr, r.stderr
