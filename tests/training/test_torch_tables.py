"""torch.steps, python.torch_trace, torch.optimizer, torch.parameters, torch.memory and torch.dataloaders on
the real example (examples/train_gpt.py) and a planted fault (tests/targets/faults.py), read through the real
`probe` command."""

from __future__ import annotations

import math
import re

import pytest

from conftest import EXAMPLES, TARGETS, requires_torch
from harness import query_json

pytestmark = requires_torch

SEED_SLOW = (
    "SELECT module, stage, COUNT(*) as count, AVG(duration) as avg_time, SUM(duration) as total_time "
    "FROM python.torch_trace WHERE step > (SELECT MAX(step) - 5 FROM python.torch_trace) "
    "GROUP BY module, stage ORDER BY total_time DESC LIMIT 10"
)
SEED_MEMORY = (
    "SELECT step, MAX(allocated) as peak_memory, MAX(allocated) - MIN(allocated) as memory_range "
    "FROM python.torch_trace WHERE step > (SELECT MAX(step) - 20 FROM python.torch_trace) GROUP BY step ORDER BY step"
)


def scheduled_lr(step: int, base: float = 3e-3, warmup: int = 20) -> float:
    """The example's LambdaLR: the lr used by optimizer step ``step`` (the scheduler stepped step-1 times)."""
    s = step - 1
    return base * min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, 5000) / 5000)))


def test_train_gpt_tables(spawn, cli):
    # given: the example, tracing every 10th step, run until step 40 is printed; every step measured
    # (the step budget leaves loss and grad norm NULL on the steps it skips, and a loaded test host
    # makes it skip some: tests/training/test_torch_budget.py covers that; here the values themselves are checked)
    proc = spawn(
        [EXAMPLES / "train_gpt.py", "--print-every", "10"], env={"PROBE_TRACE": "10", "PROBE_STEP_BUDGET": "off"}
    )
    proc.wait_for("step 40 ")
    printed = {
        int(m.group(1)): float(m.group(2))
        for m in (re.match(r"step (\d+) loss ([\d.]+)", line) for line in proc.lines)
        if m
    }

    # then: torch.steps has one row per step, plausible and matching what the loop printed
    steps = query_json(cli, proc.pid, "SELECT * FROM torch.steps ORDER BY step")
    nums = [r["step"] for r in steps]
    assert nums == list(range(1, len(nums) + 1)) and len(nums) >= 40
    assert all(r["duration"] > 0 for r in steps)
    assert all(r["ended_at"] >= r["started_at"] for r in steps)
    for n, loss in printed.items():
        assert steps[n - 1]["loss"] == pytest.approx(loss, abs=1e-4)
    losses = [r["loss"] for r in steps[:40]]
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10
    for r in steps[:40]:
        assert r["lr"] == pytest.approx(scheduled_lr(r["step"]), rel=1e-5)
        assert r["grad_norm"] > 0 and math.isfinite(r["grad_norm"])
        assert r["optimizer"] == "AdamW"
    for r in steps[1:40]:  # the batch hook is placed once the model is found, at the end of step 1
        assert r["samples"] == 16 and r["tokens"] == 16 * 32 and r["micro_batches"] == 1
        assert r["tokens_per_s"] == pytest.approx(512 / r["duration"], rel=1e-6)
    assert {r["step"] for r in steps if r["traced"]} == {n for n in nums if n <= 3 or n % 10 == 0}

    # then: module traces exist for the sampled steps only, with real module paths
    trace = query_json(
        cli,
        proc.pid,
        f"SELECT step, module, stage, duration, depth, allocated, seq FROM python.torch_trace WHERE step <= {nums[-1]}",
    )  # training goes on between queries
    assert {r["step"] for r in trace} <= {n for n in nums if n <= 3 or n % 10 == 0}
    assert {1, 2, 3, 10, 20, 30} <= {r["step"] for r in trace}
    modules = {r["module"] for r in trace}
    assert {"model", "blocks.0.attn", "blocks.1.mlp.0", "head", "ln_f"} <= modules
    assert all(r["duration"] > 0 and r["allocated"] > 0 for r in trace)
    assert {(r["module"], r["stage"]) for r in trace if r["stage"] == "backward"} == {("model", "backward")}
    per_step = [r for r in trace if r["step"] == 20]
    assert sorted(r["seq"] for r in per_step) == list(range(len(per_step)))
    assert min(per_step, key=lambda r: r["seq"])["module"] == "model"

    slow = query_json(cli, proc.pid, SEED_SLOW)
    assert 0 < len(slow) <= 10 and slow[0]["total_time"] >= slow[-1]["total_time"]
    assert slow[0]["module"] == "model"  # the root encloses everything else
    mem = query_json(cli, proc.pid, SEED_MEMORY)
    assert mem and all(r["peak_memory"] > 10_000_000 and r["memory_range"] >= 0 for r in mem)

    # then: the optimizer table shows AdamW's state: exp_avg + exp_avg_sq (fp32) and a step scalar per parameter
    (opt,) = query_json(cli, proc.pid, "SELECT * FROM torch.optimizer")
    assert opt["optimizer"] == "AdamW" and opt["scheduler"] == "LambdaLR" and opt["is_lead"]
    assert opt["state_bytes"] == opt["elements"] * 4 * 2 + opt["params"] * 4
    assert opt["initial_lr"] == pytest.approx(3e-3) and opt["weight_decay"] == pytest.approx(0.01)
    assert (opt["beta1"], opt["beta2"]) == (0.9, 0.999) and opt["step_count"] >= 40

    params = query_json(cli, proc.pid, "SELECT * FROM torch.parameters")
    assert sum(p["numel"] for p in params) == opt["elements"] and len(params) == opt["params"]
    assert all(p["in_optimizer"] and p["nan_count"] == 0 and p["model"] == "model" for p in params)
    assert {"head.weight", "blocks.0.attn.in_proj_weight"} <= {p["name"] for p in params}

    (cpu,) = query_json(cli, proc.pid, "SELECT * FROM torch.memory")
    assert cpu["device"] == "cpu" and cpu["rss"] > 10_000_000

    # then: the loader, a global, once: the loop's ``data = iter(train_loader)`` is the same loader's iterator
    (loader,) = query_json(cli, proc.pid, "SELECT * FROM torch.dataloaders")
    keys = ("name", "loader_type", "dataset_type", "batch_size", "num_workers", "sampler", "shuffle", "source")
    assert {k: loader[k] for k in keys} == {
        "name": "train_loader",
        "loader_type": "DataLoader",
        "dataset_type": "ArithmeticSequences",
        "batch_size": 16,
        "num_workers": 0,
        "sampler": "_InfiniteConstantSampler",  # an IterableDataset's: it has no order of its own, nor a length
        "shuffle": None,
        "source": "__main__",
    }

    (info,) = query_json(cli, proc.pid, "SELECT step, state, last_step_at FROM process.info")
    assert info["state"] == "training" and info["step"] >= 40
    errors = query_json(cli, proc.pid, "SELECT source, message FROM probe.errors")
    assert errors == []


def test_the_demos_step_health_query_shows_measured_grad_norms(spawn, cli):
    # given: the demo's job (examples/train_gpt.py at probe's defaults: grad norms on the steps the budget allows)
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo", EXAMPLES / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    proc = spawn([EXAMPLES / "train_gpt.py", "--print-every", "100"], ready="step 100 ", timeout=180)
    # when: the demo's step-health query runs, as the demo runs it at step 100
    rows = query_json(cli, proc.pid, demo.STEP_HEALTH)
    # then: it shows steps with a measured norm, latest first
    assert rows and all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in rows), rows
    assert [r["step"] for r in rows] == sorted((r["step"] for r in rows), reverse=True), rows


def test_dataloaders_table_describes_a_loader_kept_as_its_iterator(spawn, cli):
    # given: the data_wait fault: ``loader = iter(DataLoader(SlowSamples(), batch_size=64))``, no workers
    proc = spawn(
        [TARGETS / "faults.py", "--fault", "data_wait", "--settle", "3"],
        env={"PROBE": "1"},
        ready="planted",
        timeout=120,
    )
    # when
    rows = query_json(cli, proc.pid, "SELECT * FROM torch.dataloaders")
    # then: one row, described from the iterator's own copy of the loader's settings
    assert rows == [
        {
            "rank": None,
            "name": "loader",
            "loader_type": "_SingleProcessDataLoaderIter",
            "dataset_type": "SlowSamples",
            "iterable_dataset": False,
            "batch_size": 64,
            "num_workers": 0,
            "pin_memory": False,
            "prefetch_factor": None,
            "persistent_workers": False,
            "drop_last": False,
            "sampler": "SequentialSampler",
            "shuffle": False,
            "sampler_epoch": None,
            "source": "__main__",
        }
    ]
    assert query_json(cli, proc.pid, "SELECT source, message FROM probe.errors") == []
