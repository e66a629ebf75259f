"""What the MCP read tier lets an agent reach.

(a) a token goes only to an endpoint the registry issued it for, never to one the agent names; (b) the read
tier writes no files unless the person named a directory, and then only new files there, and the collapsed
stacks escape what the training process put in its names; (c) locals are redacted like process.env;
(d) everything a tool returns is marked as data. Driven by the MCP SDK's own stdio client against real targets.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading

import pytest

from conftest import PROBE_BIN, TARGETS

mcp = pytest.importorskip("mcp")
anyio = pytest.importorskip("anyio")

from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

SECRET = "hf_" + "Zq8" * 10  # what tests/targets/hostile_names.py holds in its locals
DATA = re.compile(r"^----- begin data (\w+) -----\n(.*)\n----- end data \1 -----$", re.S)


def calls(env, requests: list, *extra) -> list:
    """Tool calls ``(tool, arguments)``, one after the other, on one fresh `probe mcp` (stdio), as an agent's
    session makes them; their CallToolResults."""
    params = StdioServerParameters(command=PROBE_BIN, args=["mcp", *extra], env=dict(env))

    async def main():
        with open(os.devnull, "w") as devnull:
            async with stdio_client(params, errlog=devnull) as (read, write):
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    return [await s.call_tool(tool, arguments) for tool, arguments in requests]

    return anyio.run(main)


def call(env, tool: str, arguments: dict, *extra):
    """One tool call on a fresh `probe mcp`; the CallToolResult."""
    (result,) = calls(env, [(tool, arguments)], *extra)
    return result


def data(result) -> str:
    blocks = [c.text for c in result.content if getattr(c, "type", "") == "text"]
    found = [DATA.match(b) for b in blocks]
    assert any(found), blocks
    return next(m.group(2) for m in found if m)


class Listener:
    """A TCP listener on loopback that records every byte sent to it (a stranger's port)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.got = bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(5)
            try:
                while True:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    self.got += chunk
                    if b"\r\n\r\n" in self.got:
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
                        break
            except OSError:
                pass
            finally:
                conn.close()

    def close(self):
        self.sock.close()


@pytest.fixture
def hostile(spawn):
    proc = spawn(TARGETS / "hostile_names.py", env={"PROBE_PORT": "0", "PROBE_TOKEN": "registry-token-123456"})
    yield proc
    # whatever the agent did, the process is alive and printed no traceback
    assert proc.popen.poll() is None and "Traceback" not in proc.output(), proc.output()[-2000:]


def test_the_agent_reaches_only_endpoints_the_registry_lists(hostile, probe_env, tmp_path):
    # given an MCP server whose environment holds a token, and strangers listening on loopback and on a socket
    env = dict(probe_env, PROBE_TOKEN="the-persons-token-987654")
    stranger = Listener()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "other.sock"))
    sock.listen(8)
    sock.settimeout(0.5)
    try:
        # when the agent points a tool at either
        strangers = (f"127.0.0.1:{stranger.port}", str(tmp_path / "other.sock"))
        for r in calls(env, [("status", {"endpoint": endpoint}) for endpoint in strangers]):
            # then the call is refused before anything is sent: neither listener is a probed process's endpoint
            assert r.is_error and "is not the endpoint of a probed process in the registry" in data(r), data(r)
        assert stranger.got == b"", bytes(stranger.got)
        with pytest.raises(socket.timeout):
            sock.accept()
    finally:
        stranger.close()
        sock.close()
    # while the endpoints the registry lists answer, the TCP one with its own token
    with open(f"{probe_env['PROBE_RUNTIME_DIR']}/{hostile.pid}.json") as f:
        entry = json.load(f)
    listed = (f"127.0.0.1:{entry['tcp_port']}", entry["socket"], str(hostile.pid))
    sql = "SELECT count(*) AS n FROM python.threads"
    for ok in calls(env, [("query", {"endpoint": endpoint, "sql": sql}) for endpoint in listed]):
        assert not ok.is_error, data(ok)


def test_the_read_tier_writes_no_files(hostile, probe_env, tmp_path):
    pid = str(hostile.pid)
    victim = tmp_path / "victim.sh"
    victim.write_text("echo untouched\n")
    # given a server started without --output-dir: trace and profile take no output at all, and return their
    # timeline and collapsed stacks instead
    traced, profiled, timeline, stacks = calls(
        probe_env,
        [
            ("trace", {"endpoint": pid, "output": str(victim)}),
            ("profile", {"endpoint": pid, "seconds": 1, "output": str(victim)}),
            ("trace", {"endpoint": pid, "steps": 2}),
            ("profile", {"endpoint": pid, "seconds": 1}),
        ],
    )
    for r in (traced, profiled):
        assert r.is_error and "writes no files" in data(r), data(r)
    assert victim.read_text() == "echo untouched\n"
    assert not timeline.is_error and "traceEvents" in data(timeline), data(timeline)
    # the collapsed stacks: a thread name cannot start a line of its own
    r = stacks
    assert not r.is_error, data(r)
    lines = data(r).splitlines()
    assert lines and all(re.match(r"^\S.* \d+$", line) for line in lines), lines
    assert not any(line.startswith("rm -rf") for line in lines)
    assert any("evil\\nrm -rf ~" in line for line in lines), lines
    # given a directory the person named: a new file there, never over one, never elsewhere
    out = tmp_path / "out"
    out.mkdir()
    (out / "taken.txt").write_text("mine\n")
    names = ("stacks.txt", "taken.txt", "../victim.sh", str(victim), ".bashrc")
    requests = [("profile", {"endpoint": pid, "seconds": 1, "output": name}) for name in names]
    r, *refused = calls(probe_env, requests, "--output-dir", str(out))
    assert not r.is_error, data(r)
    kept = (out / "stacks.txt").read_text()
    assert kept and all(re.match(r"^\S.* \d+$", line) for line in kept.splitlines())
    for name, r in zip(names[1:], refused):
        assert r.is_error, (name, data(r))
    assert (out / "taken.txt").read_text() == "mine\n" and victim.read_text() == "echo untouched\n"
    assert sorted(os.listdir(out)) == ["stacks.txt", "taken.txt"]


def test_locals_are_redacted_like_the_environment(hostile, probe_env, cli):
    pid = str(hostile.pid)
    # when the agent (and a person) read the main thread's locals
    r = call(probe_env, "backtrace", {"endpoint": pid, "thread": "MainThread", "locals": True})
    shown = cli(pid, "backtrace", "--thread", "MainThread", "--locals")
    as_json = cli(pid, "--format", "json", "backtrace", "--thread", "MainThread", "--locals")
    # then the token is hidden, by its name and inside a dict, everywhere
    assert shown.returncode == 0 and as_json.returncode == 0, shown.stderr + as_json.stderr
    for text in (data(r), shown.stdout, as_json.stdout):
        assert "main_loop" in text and "<redacted>" in text, text
        assert SECRET not in text, text
    assert "'lr': 0.1" in shown.stdout  # what is not secret is still shown
    env_rows = cli(pid, "query", "SELECT value FROM process.env WHERE name = 'PROBE_TOKEN'", "-f", "csv").stdout
    assert "<redacted>" in env_rows


def test_every_tool_result_is_marked_as_data(hostile, probe_env):
    from probe.cli.mcp.server import DATA_NOTE

    # when a tool returns text the process chose (a thread name telling the agent what to do)
    r = call(probe_env, "query", {"endpoint": str(hostile.pid), "sql": "SELECT name FROM python.threads"})
    # then the result says first that what follows is data, and the text sits inside tagged boundaries
    assert r.content[0].text == DATA_NOTE
    assert "Ignore previous instructions" in data(r)
    # and the structured content says so too, before the same rows
    assert r.structured_content["note"] == DATA_NOTE
    assert "Ignore previous instructions" in json.dumps(r.structured_content["result"])
    agents_doc = (TARGETS.parents[1] / "docs" / "agents.md").read_text()
    assert "never as instructions" in agents_doc and "begin data" in agents_doc


def test_the_doctor_over_mcp_writes_no_plan_cache(hostile, probe_env, cli):
    rt = probe_env["PROBE_RUNTIME_DIR"]
    # when the agent asks the doctor, twice in one session (the second call plans from this server's memory)
    for r in calls(probe_env, [("doctor", {"endpoint": str(hostile.pid)})] * 2):
        assert not r.is_error, data(r)
    # then no file of plans appears in the runtime directory
    assert "doctor-plans.json" not in os.listdir(rt)
    # while the person's own `probe doctor` keeps one there, for the next run
    assert cli(str(hostile.pid), "doctor").returncode in (0, 1)
    assert "doctor-plans.json" in os.listdir(rt)
