"""Issue 25 item 5: an endpoint that is not ours (a fake speaking the snapshot protocol) never reaches the
client's DuckDB with its own SQL, never gets a traceback out of the CLI, and `probe mcp` does not outlive
its client.

The fake server here is the attacker: a tiny HTTP server in the test. Our own server is never mocked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import PROBE_BIN, poll

# A column type that would turn the client's typed view into a query over range(1e14) (issue 25, item 5).
EVIL_TYPE = (
    'BIGINT) AS "step", CAST(0 AS BIGINT) AS "__slot" FROM (SELECT r.range AS step FROM '
    'range(100000000000000) r, "__r0__torch__steps") --'
)
SCHEMA = {
    "tables": [
        {
            "name": "torch.steps",
            "kind": "ring",
            "description": "Steps.",
            "examples": [],
            "columns": [{"name": "step", "type": "BIGINT", "description": "Step."}],
        }
    ]
}


def _snapshot(column: dict) -> bytes:
    header = json.dumps(
        {
            "meta": {},
            "tables": {"torch.steps": {"rows": 1, "columns": [dict(column, kind="i8", buffers=[[0, 8], None])]}},
        }
    ).encode()
    return b"PRBC" + struct.pack("<I", len(header)) + header + struct.pack("<q", 1)


class Fake:
    """A listener on 127.0.0.1 answering every route as ``answer(path) -> (content type, body)`` (None: never
    answer)."""

    def __init__(self, answer):
        outer = self
        self.paths: list[str] = []
        self.hold = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.paths.append(self.path)
                reply = answer(self.path)
                if reply is None:  # a listener that takes the request and never answers
                    outer.hold.wait(120)
                    return
                ctype, body = reply
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    made = []

    def start(answer):
        made.append(Fake(answer))
        return made[-1]

    yield start
    for f in made:
        f.close()


def _json(doc) -> tuple:
    return "application/json", json.dumps(doc).encode()


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["query", "SELECT 1"],
        ["tables"],
        ["describe", "torch.steps"],
        ["backtrace"],
        ["doctor"],
        ["profile", "--seconds", "1"],
    ],
)
def test_a_reply_of_empty_json_gives_one_sentence(fake, cli, command):
    # given a listener that answers {} to everything
    f = fake(lambda path: _json({}))
    # when the CLI is pointed at it (with a token the person typed)
    r = cli("-t", f.endpoint, "--token", "typed-by-the-person", *command, timeout=60)
    # then one sentence and a non-zero exit, never a traceback
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr and "KeyError" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines and "did not answer like a probe" in lines[-1], r.stderr


def test_a_column_type_carrying_sql_never_reaches_duckdb(fake, cli):
    # given a fake whose schema is plausible and whose snapshot declares a type that is SQL
    f = fake(
        lambda path: (
            ("application/octet-stream", _snapshot({"name": "step", "type": EVIL_TYPE}))
            if path.startswith("/snapshot")
            else _json(SCHEMA)
        )
    )
    # when a query reads the column (with a long timeout, so that only the refusal can end it early)
    r = cli(
        "-t",
        f.endpoint,
        "--token",
        "typed-by-the-person",
        "--timeout",
        "120",
        "query",
        "SELECT max(step) AS m FROM torch.steps",
        timeout=110,
    )
    # then the snapshot is refused with a sentence naming the type, before any SQL is built from it
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "not one of BIGINT" in r.stderr and "timeout" not in r.stderr, r.stderr
    # and so are a column name and a table name that are not identifiers
    for column in ({"name": 'step" FROM x --', "type": "BIGINT"},):
        g = fake(
            lambda path, c=column: (
                ("application/octet-stream", _snapshot(c)) if path.startswith("/snapshot") else _json(SCHEMA)
            )
        )
        r = cli("-t", g.endpoint, "--token", "typed-by-the-person", "query", "SELECT max(step) FROM torch.steps")
        assert r.returncode != 0 and "is not letters, digits and _" in r.stderr, r.stderr
    h = fake(
        lambda path: _json({"tables": [dict(SCHEMA["tables"][0], columns=[{"name": "step", "type": "INT); DROP"}])]})
    )
    r = cli("-t", h.endpoint, "--token", "typed-by-the-person", "query", "SELECT 1")
    assert r.returncode != 0 and "not one of BIGINT" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_workspace_timeout_interrupts_set_up_statements():
    from probe.sql.engine import Workspace
    from probe import QueryError

    # given a workspace whose whole set-up may take 0.5 s
    ws = Workspace(timeout=0.5)
    try:
        # when a set-up statement would run for hours
        with pytest.raises(QueryError) as err:
            ws.run("CREATE TABLE t AS SELECT sum(range) AS s FROM range(100000000000000)")
        # then DuckDB was interrupted and the refusal says it was the timeout
        assert "timeout" in err.value.message
    finally:
        ws.close()


def _mcp(env, *, parent_shell: bool = False):
    if parent_shell:  # probe mcp as the child of a shell we can kill, its stdin a pipe the shell keeps
        return subprocess.Popen(
            ["sh", "-c", f'exec 3<&0; "{PROBE_BIN}" mcp --timeout 600 0<&3 3<&- & echo $!; wait'],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    return subprocess.Popen(
        [PROBE_BIN, "mcp", "--timeout", "600"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )


def _rpc(proc, msgs):
    for m in msgs:
        proc.stdin.write((json.dumps(m) + "\n").encode())
    proc.stdin.flush()


_INIT = [
    {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}},
    },
    {"jsonrpc": "2.0", "method": "notifications/initialized"},
]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Silent:
    """A unix socket that takes connections and never answers (no token is involved on a socket)."""

    def __init__(self, path: str):
        self.path, self.conns = path, []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def silent(probe_env):
    s = Silent(os.path.join(probe_env["PROBE_RUNTIME_DIR"], "silent.sock"))
    yield s
    s.close()


def test_probe_mcp_exits_when_its_client_closes_stdin_mid_call(silent, probe_env):
    # given `probe mcp` busy with a call to a listener that never answers
    proc = _mcp(probe_env)
    try:
        _rpc(
            proc,
            _INIT
            + [
                {
                    "jsonrpc": "2.0",
                    "id": 2,
                    "method": "tools/call",
                    "params": {"name": "tables", "arguments": {"endpoint": "/nonexistent.sock"}},
                }
            ],
        )
        assert json.loads(proc.stdout.readline())["id"] == 1
        assert json.loads(proc.stdout.readline())["id"] == 2  # a quick answer: the server is up and serving
        _rpc(
            proc,
            [
                {
                    "jsonrpc": "2.0",
                    "id": 3,
                    "method": "tools/call",
                    "params": {"name": "tables", "arguments": {"endpoint": silent.path}},
                }
            ],
        )
        assert poll(lambda: silent.conns, 30), "the call never reached the listener"
        # when the client goes (its end of stdin closes) while the call hangs
        proc.stdin.close()
        # then the server exits, without waiting for the call
        assert poll(lambda: proc.poll() is not None, 60), "probe mcp outlived its client"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_probe_mcp_exits_when_its_parent_dies(silent, probe_env):
    # given `probe mcp` started by a shell that keeps its stdin open, busy with a call that never ends
    shell = _mcp(probe_env, parent_shell=True)
    mcp_pid = int(shell.stdout.readline())
    try:
        _rpc(
            shell,
            _INIT
            + [
                {
                    "jsonrpc": "2.0",
                    "id": 3,
                    "method": "tools/call",
                    "params": {"name": "tables", "arguments": {"endpoint": silent.path}},
                }
            ],
        )
        assert poll(lambda: silent.conns, 30), "the call never reached the listener"
        # when the parent dies (SIGKILL: it cannot close anything) and stdin stays open in our hands
        os.kill(shell.pid, signal.SIGKILL)
        shell.wait()
        # then probe mcp notices and exits
        assert poll(lambda: not _alive(mcp_pid), 60), "probe mcp outlived its parent"
    finally:
        try:
            os.kill(mcp_pid, signal.SIGKILL)
        except OSError:
            pass
        shell.stdin.close()
