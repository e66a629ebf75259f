"""Discovery across nodes through a shared registry directory (PROBE_REGISTRY).

Each "node" gets its own runtime directory, and the ranks' unix sockets are removed
after start, so the CLI (with a third runtime directory) can only reach them the way
it would reach another node: through the shared registry, over TCP, with the job token.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from conftest import TARGETS
from harness import Recorder


@pytest.fixture
def dirs():
    made = {name: tempfile.mkdtemp(prefix=f"pr{name}-", dir="/tmp") for name in ("shared", "a", "b", "cli")}
    yield made
    for d in made.values():
        shutil.rmtree(d, ignore_errors=True)


def test_ranks_found_through_the_shared_registry_over_tcp(spawn, cli, dirs):
    # given: two ranks on two "nodes" writing to one shared registry
    procs = _two_ranks(spawn, dirs)
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


def _two_ranks(spawn, dirs) -> dict:
    """Ranks 0 and 1 of one job on two "nodes", reachable only through the shared registry over TCP: rank -> proc."""
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
    return procs


def _ask(port: int, authorization: str) -> tuple[int, dict]:
    """One GET /health to 127.0.0.1:``port`` with ``authorization``: (status, answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: {authorization}\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_one_ranks_key_opens_no_other_rank(spawn, cli, dirs):
    from probe.util import handshake

    # given two ranks of one job; each registry entry holds a key of its own, never the job's token
    _two_ranks(spawn, dirs)
    entries = {e["rank"]: e for e in (json.loads(p.read_text()) for p in Path(dirs["shared"]).glob("*.json"))}
    token = (Path(dirs["shared"]) / "token").read_text().strip()
    assert all("token" not in e and token not in json.dumps(e) for e in entries.values()), entries
    key0, key1, port1 = entries[0]["key"], entries[1]["key"], entries[1]["tcp_port"]
    assert key0 != key1

    # when rank 0's key is used on rank 1: as a typed token, as a bearer token, and in a request's proof
    typed = cli("--token", key0, f"127.0.0.1:{port1}", "query", "SELECT 1", env={"PROBE_RUNTIME_DIR": dirs["cli"]})
    bearer = _ask(port1, f"Bearer {key0}")
    status, challenge = _ask(port1, f"Probe-Challenge {handshake.new_nonce()}")
    nonce = challenge["challenge"]["nonce"]
    signed = _ask(port1, f"Probe-HMAC {nonce} {handshake.request_mac(key0, nonce, 'GET /health')}")

    # then every one is refused, while rank 1's own key opens it, once per nonce
    assert typed.returncode == 4 and "did not prove" in typed.stderr, typed.stderr
    assert status == 401 and bearer[0] == 401 and signed[0] == 401, (bearer, signed)
    nonce = _ask(port1, f"Probe-Challenge {handshake.new_nonce()}")[1]["challenge"]["nonce"]
    own = f"Probe-HMAC {nonce} {handshake.request_mac(key1, nonce, 'GET /health')}"
    assert _ask(port1, own)[0] == 200 and _ask(port1, own)[0] == 401  # a replayed request is refused


def _stranger(port: int, claim: dict) -> Recorder:
    """A plain socket server on a freed port: records every request and answers it with a forged proof that it is
    the rank the registry names (it read the registry; it does not hold the key)."""
    body = json.dumps({"error": "x", "kind": "auth", "exit_code": 4, "challenge": {**claim, "nonce": "n" * 24}})
    head = b"HTTP/1.1 401 Unauthorized\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    return Recorder(port, head + body.encode())


def test_a_dead_ranks_freed_port_gets_nothing_secret_and_is_named_unproven(spawn, cli, dirs):
    # given two ranks of one job, and rank 1 dead on its node (its shared entry left behind) with a stranger on
    # its freed port
    procs = _two_ranks(spawn, dirs)
    paths = {json.loads(p.read_text())["rank"]: p for p in Path(dirs["shared"]).glob("*.json")}
    entries = {rank: json.loads(p.read_text()) for rank, p in paths.items()}
    token = (Path(dirs["shared"]) / "token").read_text().strip()
    procs[1].popen.kill()
    procs[1].popen.wait(30)
    dead = dict(entries[1], host="localhost", tcp_host="0.0.0.0")  # "another node" that resolves here
    paths[1].write_text(json.dumps(dead))
    claim = {"rank": 1, "host": "localhost", "port": dead["tcp_port"], "pid": dead["pid"], "proof": "0" * 64}
    stranger = _stranger(dead["tcp_port"], claim)
    env = {"PROBE_RUNTIME_DIR": dirs["cli"], "PROBE_REGISTRY": dirs["shared"]}
    try:
        # when the owner lists the processes and asks every rank's status
        listed = cli("list", "--json", env=env)
        status = cli("--ranks", "all", "--format", "json", "status", env=env)
    finally:
        stranger.close()

    # then the stranger was asked to prove itself and got nothing secret: a nonce, no token, no key, no MAC
    assert len(stranger.got) >= 2, (stranger.got, status.stderr)
    for request in stranger.got:
        auth = re.findall(rb"(?im)^authorization: *(.*?)\r?$", request)
        assert len(auth) == 1 and re.fullmatch(rb"Probe-Challenge [A-Za-z0-9_-]{16,64}", auth[0]), request
        for secret in (token, entries[0]["key"], entries[1]["key"]):
            assert secret.encode() not in request, request
    # and both commands say that rank 1 did not prove itself, while rank 0 answers
    rows = {row["rank"]: row for row in json.loads(listed.stdout)}
    assert rows[1]["state"] == "unreachable" and "did not prove" in rows[1]["reason"], rows[1]
    assert rows[0]["state"] != "unreachable", rows[0]
    states = {row["rank"]: row for row in json.loads(status.stdout)}
    assert states[0]["state"] == "idle" and "did not prove" in json.dumps(states[1]), states
    assert "did not prove" in status.stderr and "Traceback" not in status.stderr, status.stderr
