"""An endpoint that is not ours (a fake speaking probe's protocol, on a freed port or another user's socket)
never reaches the client's DuckDB with its own SQL, never gets a traceback out of the CLI, never makes it copy
a file the answer names, grow without bound or outlive its timeout; and `probe mcp` does not outlive its
client.

The fake server here is the attacker: a tiny HTTP server in the test. Our own server is never mocked.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import socketserver
import struct
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import PROBE_BIN, poll
from probe.util import handshake

# A column type that would turn the client's typed view into a query over range(1e14).
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


TYPED = "typed-by-the-person"  # the token the tests type: the fake holds it (a probe gone bad, not a stranger)


class Fake:
    """A listener on 127.0.0.1 (or on the unix socket ``unix``) answering every route as ``answer(path)``:
    ``(content type, body)`` or ``(status, content type, body)``, the body bytes or an iterable of bytes sent
    as they come (with no Content-Length); None: never answer. ``sent`` counts the body bytes it wrote. Over
    TCP it first proves it holds the key of ``TYPED``, as a probe does (``probe.util.handshake``)."""

    def __init__(self, answer, unix: str | None = None):
        outer = self
        self.paths: list[str] = []
        self.sent = 0
        self.hold = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                scheme, _, cnonce = self.headers.get("Authorization", "").partition(" ")
                if scheme == "Probe-Challenge":
                    me = handshake.identity_of(None, "fake", self.server.server_address[1], 1)
                    key = handshake.rank_key(TYPED, me)
                    reply = ("application/json", json.dumps(handshake.challenge_answer(key, me, cnonce, "n" * 24)))
                    self.send_response(401)
                    self.send_header("Content-Length", str(len(reply[1])))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(reply[1].encode())
                    return
                outer.paths.append(self.path)
                reply = answer(self.path)
                if reply is None:  # a listener that takes the request and never answers
                    outer.hold.wait(120)
                    return
                status, ctype, body = reply if len(reply) == 3 else (200, *reply)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                if isinstance(body, bytes):
                    self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    for part in [body] if isinstance(body, bytes) else body:
                        self.wfile.write(part)
                        self.wfile.flush()
                        outer.sent += len(part)
                        if outer.hold.is_set():
                            return
                except OSError:  # the client stopped reading and closed
                    pass

            do_GET = do_POST = _any

            def address_string(self):
                return "fake"

        if unix:
            self.server = socketserver.ThreadingUnixStreamServer(unix, Handler)
            self.endpoint = unix
        else:
            self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    made = []

    def start(answer, unix=None):
        made.append(Fake(answer, unix))
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
    r = cli("-t", f.endpoint, "--token", TYPED, *command, timeout=60)
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
        TYPED,
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
        r = cli("-t", g.endpoint, "--token", TYPED, "query", "SELECT max(step) FROM torch.steps")
        assert r.returncode != 0 and "is not letters, digits and _" in r.stderr, r.stderr
    h = fake(
        lambda path: _json({"tables": [dict(SCHEMA["tables"][0], columns=[{"name": "step", "type": "INT); DROP"}])]})
    )
    r = cli("-t", h.endpoint, "--token", TYPED, "query", "SELECT 1")
    assert r.returncode != 0 and "not one of BIGINT" in r.stderr and "Traceback" not in r.stderr, r.stderr


TOKEN = ("--token", TYPED)


def _last_line(r) -> str:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _spaces(total: int, then: bytes = b"{}"):
    """A body of ``total`` bytes of JSON whitespace, then ``then``, made as it is sent."""
    step = 1 << 20
    for _ in range(total // step):
        yield b" " * step
    yield then


@pytest.mark.parametrize("route", ["json", "snapshot"])
def test_an_answer_larger_than_a_probe_sends_is_cut_off(fake, cli, route):
    # given a fake whose answer is 64 MiB: a JSON answer past the client's cap, or a snapshot past four times
    # this shell's PROBE_SNAPSHOT_BYTES (1 MB here)
    total = 64 << 20

    def answer(path):
        if route == "snapshot" and not path.startswith("/snapshot"):
            return _json(SCHEMA)
        return "application/octet-stream", _spaces(total)

    f = fake(answer)
    # when the CLI asks it
    command = ["status"] if route == "json" else ["query", "SELECT max(step) FROM torch.steps"]
    r = cli("-t", f.endpoint, *TOKEN, *command, env={"PROBE_SNAPSHOT_BYTES": "1MB"}, timeout=120)
    # then it stops reading at its cap and says so in one sentence, exit 3
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert "sent an answer larger than" in _last_line(r), r.stderr
    assert f.sent < total, "the CLI read the whole answer"


def _drip(path):
    """Headers at once, then one byte of the body every half second, forever."""

    def body():
        while True:
            yield b" "
            time.sleep(0.5)  # ok-sleep: the attacker's pace, not synchronization

    return "application/json", body()


def test_a_drip_fed_answer_ends_at_the_timeout(fake, cli):
    # given a fake that answers one byte every half second, each well within the timeout, without end
    f = fake(_drip)
    # when the CLI asks it with a 2 s timeout (the harness gives up at 30 s: a drip would outlive that)
    r = cli("-t", f.endpoint, *TOKEN, "--timeout", "2", "status", timeout=30)
    # then the timeout bounds the whole request, not each read: one sentence, exit 3
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert "did not answer within 2 s" in _last_line(r), r.stderr
    # and an endpoint named by its address, with no pid known here, gets no command to paste with a literal PID
    assert "try `probe PID backtrace`" not in r.stderr and "on its host, `probe PID backtrace`" in r.stderr, r.stderr


def _profile_steps(chunks, declared: int, path: str = "/nonexistent/profile.json"):
    """A fake's answers to `profile-steps`: the action done at once, a finished profile that says it has
    ``declared`` bytes at ``path``, then ``chunks(offset)`` -> (data, next) for each read."""
    from urllib.parse import parse_qs, urlparse

    def answer(url):
        if url.startswith("/actions/profile-steps"):
            result = {"from_step": 1, "until_step": 2, "activities": ["CPU"], "path": path}
            return _json({"action": {"id": 1, "state": "done", "result": result}})
        query = parse_qs(urlparse(url).query)
        if url.startswith("/profile-steps") and "offset" in query:
            offset = int(query["offset"][0])
            data, following = chunks(offset)
            return _json({"data": data, "offset": offset, "next": following, "size": declared})
        if url.startswith("/profile-steps"):
            profile = {"action_id": 1, "state": "done", "path": path, "bytes": declared, "from_step": 1}
            return _json({"profile": dict(profile, ended_step=2, export_s=0.1)})
        return _json({})

    return answer


def test_profile_steps_writes_what_the_answer_carries_never_a_file_it_names(fake, cli, tmp_path, probe_env):
    # given a file only this user may read, and a fake on a unix socket whose finished profile names it
    secret = tmp_path / "secret.txt"
    secret.write_text("only-mine")
    secret.chmod(0o600)
    trace = b'{"traceEvents": []}'
    answer = _profile_steps(lambda offset: (base64.b64encode(trace).decode(), None), len(trace), str(secret))
    f = fake(answer, unix=os.path.join(probe_env["PROBE_RUNTIME_DIR"], "fake.sock"))
    out = tmp_path / "prof.json"
    # when profile-steps fetches the trace from it
    r = cli(f.endpoint, "profile-steps", "2", "-o", out, timeout=60)
    # then the output holds the content the answers carried, not the file the answer named
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == trace
    assert any("offset=" in p for p in f.paths), "the trace was not read through the connection"


def test_profile_chunks_past_the_declared_size_are_refused(fake, cli, tmp_path):
    # given a fake whose profile declares 10 bytes, then hands out 1 MiB chunks that always have a next one
    # (it gives up after five, so that a client without a bound ends too)
    mib = base64.b64encode(b"x" * (1 << 20)).decode()
    f = fake(_profile_steps(lambda offset: (mib, offset + (1 << 20) if offset < 4 << 20 else None), 10))
    out = tmp_path / "prof.json"
    # when profile-steps fetches the trace
    r = cli("-t", f.endpoint, *TOKEN, "profile-steps", "2", "-o", out, timeout=60)
    # then the first chunk past the declared size ends it: one sentence, exit 3, no output, no temporary file
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert "longer or shorter than the 10 bytes" in _last_line(r), r.stderr
    assert sum("offset=" in p for p in f.paths) == 1
    assert list(tmp_path.iterdir()) == []


def _text_snapshot(rows: int, blob: bytes, ends: list) -> bytes:
    header = json.dumps(
        {
            "meta": {},
            "tables": {
                "torch.steps": {
                    "rows": rows,
                    "columns": [
                        {
                            "name": "name",
                            "type": "VARCHAR",
                            "kind": "str",
                            "buffers": [[0, 8 * len(ends)], [8 * len(ends), len(blob)], None],
                        }
                    ],
                }
            },
        }
    ).encode()
    return b"PRBC" + struct.pack("<I", len(header)) + header + struct.pack(f"<{len(ends)}q", *ends) + blob


def test_a_snapshot_whose_text_offsets_go_back_is_refused_before_decoding(fake, cli):
    # given a snapshot of 100 KB of text whose end offsets go back and forth, so that 1,000 rows each decode
    # to all of it (100 MB from 100 KB; the same at 1.1 MB decodes to gigabytes)
    blob = b"x" * 100_000
    snapshot = _text_snapshot(2000, blob, [len(blob) if i % 2 == 0 else 0 for i in range(2000)])
    schema = {"tables": [dict(SCHEMA["tables"][0], columns=[{"name": "name", "type": "VARCHAR"}])]}
    f = fake(lambda path: ("application/octet-stream", snapshot) if path.startswith("/snapshot") else _json(schema))
    # when a query reads it
    r = cli("-t", f.endpoint, *TOKEN, "query", "SELECT sum(length(name)) AS n FROM torch.steps", timeout=60)
    # then the offsets are checked before any text is built: one sentence, exit 3
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "text offsets out of order" in _last_line(r), r.stderr


def _deep(path):
    return "application/json", b"[" * 100_000


def _error(status, doc):
    return lambda path: (status, "application/json", json.dumps(doc).encode())


def _bad_base64():
    return _profile_steps(lambda offset: ("not base64 !", None), 9)


@pytest.mark.parametrize(
    "answer, command",
    [
        (lambda: _deep, ["status"]),
        (lambda: _error(400, {"error": "refused.", "kind": "action", "exit_code": "five"}), ["status"]),
        (lambda: _error(400, {"error": "refused.", "kind": "action", "exit_code": 0}), ["status"]),
        (lambda: _error(401, ["not", "an", "object"]), ["status"]),
        (_bad_base64, ["profile-steps", "2", "-o", "{tmp}/prof.json"]),
    ],
    ids=["deep-json", "string-exit-code", "zero-exit-code", "401-list", "bad-base64"],
)
def test_a_malformed_answer_gives_one_sentence_and_exit_3(fake, cli, tmp_path, answer, command):
    # given a fake whose answer is malformed in one way
    f = fake(answer())
    # when the CLI reads it
    r = cli("-t", f.endpoint, *TOKEN, *[c.format(tmp=tmp_path) for c in command], timeout=60)
    # then one sentence saying the endpoint does not answer like a probe, exit 3 (never 0, never a traceback)
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert "did not answer like a probe" in _last_line(r), r.stderr


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
    """The silent socket, listed in the registry as this test's own process (an agent reaches only those)."""
    s = Silent(os.path.join(probe_env["PROBE_RUNTIME_DIR"], "silent.sock"))
    entry = os.path.join(probe_env["PROBE_RUNTIME_DIR"], f"{os.getpid()}.json")
    with os.fdopen(os.open(entry, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "socket": s.path}, f)
    yield s
    s.close()
    os.unlink(entry)


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


def test_an_endpoints_error_text_reaches_the_terminal_escaped(fake, cli):
    # given a listener whose error answer carries a clipboard write, cursor moves, a C1 CSI and a bidi override
    evil = "no\x1b]52;c;SGVsbG8=\x07\x1b[1A\x1b[2K\x9b2J\u202e such table"
    f = fake(lambda path: _json({"error": evil, "kind": "query"}))
    # when the CLI shows it
    r = cli("-t", f.endpoint, "--token", "typed-by-the-person", "status")
    # then it is one error line with each escape as text, never the bytes a terminal obeys
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert not [c for c in ("\x1b", "\x07", "\x9b", "\u202e") if c in r.stdout + r.stderr], r.stderr
    assert "probe: no\\x1b]52;c;SGVsbG8=\\x07\\x1b[1A\\x1b[2K\\x9b2J\\u202e such table" in r.stderr, r.stderr
