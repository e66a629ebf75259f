"""`probe mcp` driven by the MCP SDK's own clients (stdio and streamable HTTP), against a real training loop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from conftest import PROBE_BIN, TARGETS, poll, requires_torch
from harness import audit_records

mcp = pytest.importorskip("mcp")
anyio = pytest.importorskip("anyio")

from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

pytestmark = requires_torch


@pytest.fixture(scope="module")
def train(shared_spawn):
    # rank 0 of a one-rank job, so that --ranks (the grouped backtrace) finds it in the registry
    return shared_spawn(
        [TARGETS / "actions_train.py", "--sched", "none", "--step-sleep", "0.02"],
        env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"},
    )


def session(env, *extra):
    """Run ``fn(client_session)`` against a fresh `probe mcp` server; returns fn's value."""
    params = StdioServerParameters(command=PROBE_BIN, args=["mcp", *extra], env=dict(env))

    def run(fn):
        async def main():
            with open(os.devnull, "w") as devnull:
                async with stdio_client(params, errlog=devnull) as (read, write):
                    async with ClientSession(read, write) as s:
                        await s.initialize()
                        return await fn(s)

        return anyio.run(main)

    return run


def text(result) -> str:
    """A tool's output: the block between its data boundaries (the note before it says it is data)."""
    blocks = [c.text for c in result.content if getattr(c, "type", "") == "text"]
    for b in blocks:
        m = re.match(r"^----- begin data (\w+) -----\n(.*)\n----- end data \1 -----$", b, re.S)
        if m:
            return m.group(2)
    return "\n".join(blocks)


def test_read_only_tools_answer_from_the_live_process(train, shared_env):
    pid = str(train.pid)

    async def go(s):
        tools = {t.name: t for t in (await s.list_tools()).tools}
        listed = await s.call_tool("list", {})
        steps = await s.call_tool(
            "query", {"endpoint": pid, "sql": "SELECT MAX(step) AS s, COUNT(*) AS n FROM torch.steps"}
        )
        write = await s.call_tool("query", {"endpoint": pid, "sql": "DROP TABLE torch.steps"})
        described = await s.call_tool("describe", {"endpoint": pid, "table": "torch.steps"})
        bt = await s.call_tool("backtrace", {"endpoint": pid, "thread": "MainThread"})
        grouped = await s.call_tool("backtrace", {"ranks": "all", "group": True, "thread": "MainThread"})
        bad = await s.call_tool("query", {"endpoint": pid, "sql": "SELECT 1", "nonsense": 1})
        resource = await s.read_resource("probe://tables")
        return tools, listed, steps, write, described, bt, grouped, bad, resource

    tools, listed, steps, write, described, bt, grouped, bad, resource = session(shared_env)(go)
    # the tools come from the command registry, with the commands' own help
    assert {"list", "status", "query", "tables", "describe", "backtrace"} <= set(tools)
    assert not {"lr", "checkpoint", "cleanup", "eval", "debug", "inject"} & set(tools), "read-only by default"
    assert tools["query"].description.startswith("Run one read-only SQL query")
    assert "torch.steps" in tools["query"].description  # the table descriptions as context
    assert tools["describe"].input_schema["required"] == ["table"]
    assert tools["query"].annotations.read_only_hint is True
    assert any(row["pid"] == train.pid for row in json.loads(text(listed)))
    assert not steps.is_error, text(steps)
    rows = steps.structured_content["result"]
    assert rows == json.loads(text(steps)) and rows[0]["s"] >= 1 and rows[0]["n"] >= 1
    assert write.is_error and text(write).startswith("probe: ") and "Traceback" not in text(write)
    assert "grad_norm" in text(described)
    assert "actions_train.py" in text(bt)
    assert not grouped.is_error and "identical stacks merged" in text(grouped) and "actions_train.py" in text(grouped)
    assert bad.is_error and "nonsense" in text(bad)
    tables = json.loads(resource.contents[0].text)
    assert any(t["name"] == "python.torch_trace" and any(c["name"] == "duration" for c in t["columns"]) for t in tables)


def test_actions_need_allow_actions_and_are_audited_as_the_agent(train, shared_env):
    pid = str(train.pid)

    from probe.cli.mcp.tools import ACTION_TOOLS

    async def refused(s):
        return {name: await s.call_tool(name, {"endpoint": pid}) for name in ACTION_TOOLS}

    answers = session(shared_env)(refused)
    assert "profile-steps" in answers  # every action tool, not a hand-kept subset
    for name, r in answers.items():
        assert r.is_error and text(r) == (
            f"probe: {name} is not available: it is an action, and this server was started without --allow-actions."
        ), (name, text(r))

    async def allowed(s):
        names = {t.name for t in (await s.list_tools()).tools}
        done = await s.call_tool("cleanup", {"endpoint": pid})
        ev = await s.call_tool("eval", {"endpoint": pid, "code": "1"})
        rows = await s.call_tool(
            "query",
            {"endpoint": pid, "sql": "SELECT command, state, client FROM probe.actions WHERE command = 'cleanup'"},
        )
        return names, done, ev, rows

    names, done, ev, rows = session(shared_env, "--allow-actions")(allowed)
    assert set(ACTION_TOOLS) <= names and not {"eval", "debug"} & names
    assert not done.is_error, text(done)
    assert done.structured_content["result"][0]["action"]["state"] == "done"
    assert ev.is_error and "never" in text(ev)
    assert '"agent": "mcp"' in text(rows) or '\\"agent\\": \\"mcp\\"' in text(rows)
    mine = [r for r in audit_records(shared_env) if r["command"] == "cleanup" and r["pid"] == train.pid]
    assert mine and all(r["client"].get("agent") == "mcp" for r in mine)
    assert {r["outcome"] for r in mine} >= {"queued", "done"}


def test_refusals_come_from_the_tool_registries():
    from probe.cli.mcp.server import unavailable_reason
    from probe.cli.mcp.tools import ACTION_TOOLS, NEVER, READ_TOOLS, tool_specs

    offered = {s.name for s in tool_specs(allow_actions=True)}
    assert {n for n in offered if n not in READ_TOOLS} == set(ACTION_TOOLS), "every offered action is in ACTION_TOOLS"
    assert all("--allow-actions" in unavailable_reason(n) for n in ACTION_TOOLS)
    assert all("never offered" in unavailable_reason(n) for n in NEVER)
    assert unavailable_reason("nonsense") == "there is no such tool"


def test_other_commands_do_not_import_the_mcp_sdk(shared_env):
    code = (
        "import sys; from probe.cli.plumbing.main import main; main(['list']); "
        "print(sorted(m for m in sys.modules if m == 'mcp' or m.startswith(('mcp.', 'mcp_types', 'anyio'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=shared_env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_mcp_refuses_a_target(shared_cli):
    r = shared_cli("mcp", "--rank", "0")
    assert r.returncode != 0 and "agent picks one per call" in r.stderr and "Traceback" not in r.stderr


# -- streamable HTTP: `probe mcp --http` --


def start_http(spawner, *extra):
    """Start `probe mcp --http 127.0.0.1:0`; (process, url, token) read from the one line it prints."""
    proc = spawner([PROBE_BIN, "mcp", "--http", "127.0.0.1:0", *extra], ready="probe mcp: http://", timeout=60)
    m = re.search(r"probe mcp: (http://127\.0\.0\.1:\d+/mcp) token (\S+) ", proc.wait_for("probe mcp: http://"))
    assert m, proc.output()
    return proc, m.group(1), m.group(2)


def http_session(url, token, fn):
    """Run ``fn(client_session)`` over the SDK's streamable HTTP client, sending the bearer token."""
    import httpx2

    async def main():
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(60)) as http:
            async with streamable_http_client(url, http_client=http) as (read, write):
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    return await fn(s)

    return anyio.run(main)


def post(url, message, **headers):
    """One raw JSON-RPC POST; (status, headers, body text)."""
    req = urllib.request.Request(
        url,
        data=json.dumps(message).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Accept": "application/json, text/event-stream", **headers},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def stop(proc, sig):
    """Send ``sig``; (exit code, everything it printed, read to the end)."""
    proc.popen.send_signal(sig)
    rc = proc.popen.wait(timeout=30)
    poll(lambda: "probe mcp: stopped." in proc.output(), 10)  # the reader thread may lag the exit
    return rc, proc.output()


def test_http_serves_the_read_only_tools_on_loopback_behind_a_token(train, shared_spawn):
    pid = str(train.pid)
    proc, url, token = start_http(shared_spawn)
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}

    # no token, a wrong one, a right one under another name: refused before any MCP handling
    no_token = post(url, ping)
    wrong = post(url, ping, Authorization=f"Bearer {token[:-1]}x")
    rebound = post(url, ping, Authorization=f"Bearer {token}", Host="attacker.example:80")
    web_page = post(url, ping, Authorization=f"Bearer {token}", Origin="http://attacker.example")
    assert no_token[0] == 401 and no_token[1]["WWW-Authenticate"].startswith("Bearer")
    assert wrong[0] == 401
    assert rebound[0] == 421 and web_page[0] == 403, "DNS-rebinding protection: Host and Origin must name loopback"

    async def go(s):
        tools = {t.name: t for t in (await s.list_tools()).tools}
        status = await s.call_tool("status", {"endpoint": pid})
        steps = await s.call_tool("query", {"endpoint": pid, "sql": "SELECT MAX(step) AS s FROM torch.steps"})
        action = await s.call_tool("cleanup", {"endpoint": pid})
        return tools, status, steps, action

    tools, status, steps, action = http_session(url, token, go)
    assert {"list", "status", "query", "describe", "backtrace"} <= set(tools)
    assert not {"lr", "checkpoint", "cleanup", "eval", "debug"} & set(tools), "read-only by default over HTTP too"
    assert "torch.steps" in tools["query"].description
    assert not status.is_error, text(status)
    assert [row["pid"] for row in status.structured_content["result"]] == [train.pid]
    assert not steps.is_error and steps.structured_content["result"][0]["s"] >= 1, text(steps)
    assert action.is_error and "--allow-actions" in text(action)

    rc, out = stop(proc, signal.SIGTERM)
    assert rc == 0 and out.rstrip().endswith("probe mcp: stopped."), out
    assert out.count(token) == 1 and "Traceback" not in out, "the token is printed once"


def test_http_actions_are_audited_as_the_agent_and_need_the_token(train, shared_spawn, shared_env):
    pid = str(train.pid)
    proc, url, token = start_http(shared_spawn, "--allow-actions")

    def cleanups():
        return [r for r in audit_records(shared_env) if r["command"] == "cleanup" and r["pid"] == train.pid]

    before = len(cleanups())
    # a session opened with the token, then a tool call on it without the token: 401, and nothing runs
    init = post(
        url,
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "raw", "version": "0"},
            },
        },
        Authorization=f"Bearer {token}",
    )
    assert init[0] == 200 and init[1]["mcp-session-id"], init
    call = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {"name": "cleanup", "arguments": {"endpoint": pid}},
    }
    on_session = {"mcp-session-id": init[1]["mcp-session-id"], "mcp-protocol-version": "2025-06-18"}
    assert post(url, call, **on_session)[0] == 401
    assert post(url, call, **on_session, Authorization=f"Bearer {'x' * len(token)}")[0] == 401

    async def go(s):
        names = {t.name for t in (await s.list_tools()).tools}
        return names, await s.call_tool("cleanup", {"endpoint": pid})

    names, done = http_session(url, token, go)
    assert {"lr", "checkpoint", "cleanup"} <= names and not {"eval", "debug"} & names
    assert not done.is_error and done.structured_content["result"][0]["action"]["state"] == "done", text(done)
    mine = cleanups()[before:]
    assert {r["outcome"] for r in mine} >= {"queued", "done"}, "exactly the authorized call ran"
    assert all(r["client"].get("agent") == "mcp" for r in mine)
    assert len([r for r in mine if r["outcome"] == "done"]) == 1

    rc, out = stop(proc, signal.SIGINT)
    assert rc == 0 and "probe mcp: stopped." in out, out


def test_http_refuses_a_non_loopback_bind_without_expose(shared_cli):
    r = shared_cli("mcp", "--http", "0.0.0.0:0")
    assert r.returncode != 0 and r.stderr.startswith(
        "probe: --http 0.0.0.0:0: 0.0.0.0 is not a loopback address; add --expose"
    )
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "call, expected",
    [
        (lambda m: m.parse_address("::1:0"), "write an IPv6 address in brackets"),
        (lambda m: m.parse_address("127.0.0.1:70000"), "is not [HOST:]PORT with a port from 0 to 65535"),
        (lambda m: m.http_token("short"), "PROBE_MCP_TOKEN must be at least 16 characters"),
    ],
)
def test_http_refuses_a_bad_address_or_a_weak_token(call, expected):
    import probe.cli.mcp.http as http
    from probe import ProbeError

    with pytest.raises(ProbeError, match=re.escape(expected)):
        call(http)
