"""`probe mcp` driven by the MCP SDK's own client over stdio, against a real training loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import PROBE_BIN, TARGETS, requires_torch

mcp = pytest.importorskip("mcp")
anyio = pytest.importorskip("anyio")

from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

pytestmark = requires_torch


@pytest.fixture(scope="module")
def train(shared_spawn):
    # rank 0 of a one-rank job, so that --ranks (the grouped backtrace) finds it in the registry
    return shared_spawn([TARGETS / "actions_train.py", "--sched", "none", "--step-sleep", "0.02"],
                        env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})


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
    return "\n".join(c.text for c in result.content if getattr(c, "type", "") == "text")


def test_read_only_tools_answer_from_the_live_process(train, shared_env):
    pid = str(train.pid)

    async def go(s):
        tools = {t.name: t for t in (await s.list_tools()).tools}
        listed = await s.call_tool("list", {})
        steps = await s.call_tool("query", {"endpoint": pid, "sql": "SELECT MAX(step) AS s, COUNT(*) AS n FROM torch.steps"})
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

    async def refused(s):
        return await s.call_tool("cleanup", {"endpoint": pid})

    r = session(shared_env)(refused)
    assert r.is_error and "--allow-actions" in text(r)

    async def allowed(s):
        names = {t.name for t in (await s.list_tools()).tools}
        done = await s.call_tool("cleanup", {"endpoint": pid})
        ev = await s.call_tool("eval", {"endpoint": pid, "code": "1"})
        rows = await s.call_tool("query", {"endpoint": pid, "sql": "SELECT command, state, client FROM probe.actions WHERE command = 'cleanup'"})
        return names, done, ev, rows

    names, done, ev, rows = session(shared_env, "--allow-actions")(allowed)
    assert {"lr", "checkpoint", "cleanup"} <= names and not {"eval", "debug"} & names
    assert not done.is_error, text(done)
    assert done.structured_content["result"][0]["action"]["state"] == "done"
    assert ev.is_error and "never" in text(ev)
    assert '"agent": "mcp"' in text(rows) or '\\"agent\\": \\"mcp\\"' in text(rows)
    with open(os.path.join(shared_env["PROBE_RUNTIME_DIR"], "audit.jsonl")) as f:
        records = [json.loads(line) for line in f]
    mine = [r for r in records if r["command"] == "cleanup" and r["pid"] == train.pid]
    assert mine and all(r["client"].get("agent") == "mcp" for r in mine)
    assert {r["outcome"] for r in mine} >= {"queued", "done"}


def test_other_commands_do_not_import_the_mcp_sdk(shared_env):
    code = ("import sys; from probe.cli._main import main; main(['list']); "
            "print(sorted(m for m in sys.modules if m == 'mcp' or m.startswith(('mcp.', 'mcp_types', 'anyio'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=shared_env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_mcp_refuses_a_target(shared_cli):
    r = shared_cli("mcp", "--rank", "0")
    assert r.returncode != 0 and "agent picks one per call" in r.stderr and "Traceback" not in r.stderr
