"""Setups of modern training code, run as users run them (PROBE=1, no probe code): activation
checkpointing (its recomputed forwards are marked, never counted as forward) and torch.compile
(the probe's queries and traced steps cause no recompilation)."""

from __future__ import annotations

import ast
import re

import pytest

from conftest import TARGETS, requires_torch
from harness import query_json

pytestmark = requires_torch
CHECKPOINTED = TARGETS / "checkpointed.py"
COMPILED = TARGETS / "compiled_loop.py"
# seed 003's "slowest modules" query, verbatim
SLOWEST = """
SELECT
    module,
    stage,
    COUNT(*) as count,
    AVG(duration) as avg_time,
    SUM(duration) as total_time
FROM python.torch_trace
WHERE step > (SELECT MAX(step) - 5 FROM python.torch_trace)
GROUP BY module, stage
ORDER BY total_time DESC
LIMIT 10"""


@pytest.mark.parametrize("reentrant", [False, True], ids=["use_reentrant=False", "use_reentrant=True"])
def test_recomputed_forwards_are_marked_and_kept_out_of_forward(spawn, cli, reentrant):
    # given: three checkpointed blocks, every step traced
    args = [CHECKPOINTED, "--step-sleep", "0.005"] + (["--reentrant"] if reentrant else [])
    p = spawn(args, env={"PROBE": "1", "PROBE_TRACE": "all"})
    p.wait_for("step 8 ")
    rows = query_json(
        cli, p.pid, "SELECT step, module, stage, depth FROM python.torch_trace WHERE step BETWEEN 2 AND 6"
    )
    # then: each module's forward is one row a step, at its own depth (root 0, blocks.N 1, their layers 2)
    forward = [r for r in rows if r["stage"] == "forward"]
    per_step = {}
    for r in forward:
        per_step[(r["step"], r["module"])] = per_step.get((r["step"], r["module"]), 0) + 1
    assert set(per_step.values()) == {1}, per_step
    want = (
        {"model": 0, "head": 1}
        | {f"blocks.{i}": 1 for i in range(3)}
        | {f"blocks.{i}.{n}": 2 for i in range(3) for n in ("ln", "fc1", "act", "fc2")}
    )
    assert {r["module"]: r["depth"] for r in forward} == want
    # the recomputation in backward is its own stage, at the depth its module has in the forward
    again = [r for r in rows if r["stage"] == "recompute"]
    assert {r["step"] for r in again} == {2, 3, 4, 5, 6}
    assert {r["module"] for r in again} >= {f"blocks.{i}.{n}" for i in range(3) for n in ("ln", "fc1", "act")}
    assert all(r["depth"] == want[r["module"]] for r in again), again
    assert max(r["depth"] for r in rows) == 2
    # seed 003's query runs verbatim, and counts each module's forward once a step
    seed = query_json(cli, p.pid, SLOWEST)
    assert seed and all(r["count"] == 5 for r in seed if r["stage"] == "forward"), seed
    assert query_json(cli, p.pid, "SELECT source, message FROM probe.errors") == []


def test_without_checkpointing_nothing_is_recompute(spawn, cli):
    p = spawn([CHECKPOINTED, "--no-checkpoint", "--step-sleep", "0.005"], env={"PROBE": "1", "PROBE_TRACE": "all"})
    p.wait_for("step 5 ")
    stages = query_json(
        cli, p.pid, "SELECT stage, COUNT(*) AS n, MAX(depth) AS depth FROM python.torch_trace GROUP BY stage"
    )
    assert {r["stage"] for r in stages} == {"forward", "backward"} and max(r["depth"] for r in stages) == 2


def _dynamo(cli, pid) -> dict:
    r = cli(pid, "eval", "dynamo()")
    assert r.returncode == 0, r.stderr
    return ast.literal_eval(r.stdout.strip())


def test_a_fullgraph_compiled_step_that_calls_the_model_trains_probed(spawn, cli):
    # given: the loss function that calls the root model compiled with fullgraph=True (a graph break is an error),
    # at defaults (the first steps measured): the probe's watchers on the root model run inside it
    p = spawn([COMPILED, "--fullgraph-step"], env={"PROBE": "1"}, timeout=240)
    # then: it trains on, each step with its loss
    p.wait_for("step 300 ", timeout=120)
    rows = query_json(cli, p.pid, "SELECT count(*) AS n, count(loss) AS losses FROM torch.steps WHERE step <= 300")
    assert rows == [{"n": 300, "losses": 300}], rows
    assert query_json(cli, p.pid, "SELECT source, message FROM probe.errors") == []
    assert not [line for line in p.lines if "Unsupported" in line or "Traceback" in line], p.lines[-20:]


def test_queries_and_traced_steps_cause_no_recompilation(spawn, cli, tmp_path):
    # given: a compiled model, module tracing going on and off every 3 steps
    p = spawn([COMPILED, "--step-sleep", "0.01"], env={"PROBE": "1", "PROBE_TRACE": "3"}, timeout=240)
    p.wait_for("step 10 ", timeout=120)  # both variants (hooks in, hooks out) compiled by now
    before = _dynamo(cli, p.pid)
    assert before["frames"] >= 1 and before["graphs"] >= 1
    start = int(re.search(r"step (\d+) ", [line for line in p.lines if line.startswith("step ")][-1]).group(1))
    # when: what a person or an agent runs against the job
    for sql in (
        SLOWEST,
        "SELECT step, loss, lr, traced FROM torch.steps ORDER BY step DESC LIMIT 20",
        "SELECT * FROM torch.optimizer",
        "SELECT name, numel FROM torch.parameters",
        "SELECT * FROM torch.memory",
        "SELECT func, depth FROM python.backtrace",
        "SELECT module, stage, depth FROM python.torch_trace "
        "WHERE step > (SELECT MAX(step) - 3 FROM python.torch_trace)",
    ):
        query_json(cli, p.pid, sql)
    assert cli(p.pid, "doctor").returncode in (0, 1)
    assert cli(p.pid, "trace", "-o", str(tmp_path / "t.json")).returncode == 0
    p.wait_for(f"step {start + 12} ", timeout=120)  # four more traced steps, hooks in and out again
    traced = query_json(cli, p.pid, f"SELECT COUNT(DISTINCT step) AS n FROM python.torch_trace WHERE step > {start}")
    assert traced[0]["n"] >= 3
    # then: dynamo compiled nothing more
    after = _dynamo(cli, p.pid)
    assert (after["frames"], after["graphs"], after["recompiles"]) == (
        before["frames"],
        before["graphs"],
        before["recompiles"],
    ), after["reasons"]
