"""The CUDA path: device-time durations from CUDA events, filled in lazily; loss read without a sync."""

from __future__ import annotations

import json
import math

import pytest

from conftest import EXAMPLES, TARGETS, poll, requires_torch
from _doctor import poll_for


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


pytestmark = [requires_torch, pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")]


def test_cuda_trace_durations_and_memory(spawn, cli):
    proc = spawn([EXAMPLES / "train_gpt.py", "--print-every", "10", "--device", "cuda"], env={"PROBE_TRACE": "all"})
    proc.wait_for("step 20 ")

    def traced() -> list:  # durations appear once the CUDA events have completed
        r = cli(
            proc.pid,
            "query",
            "SELECT step, module, stage, duration, allocated FROM python.torch_trace WHERE step <= 10",
            "-f",
            "json",
        )
        rows = json.loads(r.stdout)
        return rows if rows and all(x["duration"] is not None for x in rows) else []

    rows = poll(traced, 30)
    assert rows and all(x["duration"] is not None and x["duration"] > 0 for x in rows)
    assert all(x["allocated"] > 0 for x in rows)  # CUDA allocated bytes, not RSS
    r = cli(proc.pid, "query", "SELECT step, loss, peak_allocated FROM torch.steps WHERE step <= 10", "-f", "json")
    steps = json.loads(r.stdout)
    assert all(math.isfinite(s["loss"]) and s["peak_allocated"] > 0 for s in steps)
    mem = json.loads(cli(proc.pid, "query", "SELECT * FROM torch.memory WHERE device = 'cuda:0'", "-f", "json").stdout)
    assert mem and mem[0]["allocated"] > 0 and mem[0]["total"] > 0


def test_cuda_sync_watch_names_the_item_call_and_the_probe_adds_none(spawn, cli):
    # given: loss.item() on a CUDA loss every step, traced one step in 5
    job = spawn(
        [TARGETS / "faults.py", "--fault", "host_sync", "--device", "cuda", "--settle", "30"],
        env={"PROBE": "1", "PROBE_TRACE": "5"},
        ready="planted",
        timeout=180,
    )
    # then: torch's sync debug mode named the line, and nothing of the probe's own synchronised
    finding = poll_for(cli, job.pid, "host_syncs", timeout=90)[0]
    assert "faults.py" in finding["message"] and "loss.item()" in finding["message"]
    rows = json.loads(
        cli(job.pid, "query", "SELECT origin, via, count FROM torch.syncs WHERE origin = 'probe'", "-f", "json").stdout
    )
    assert rows == []


def test_cuda_output_statistics_land_without_a_sync(spawn, cli):
    job = spawn(
        [TARGETS / "faults.py", "--fault", "dead_relu", "--device", "cuda", "--settle", "30"],
        env={"PROBE": "1", "PROBE_TRACE": "5"},
        ready="planted",
        timeout=180,
    )
    finding = poll_for(cli, job.pid, "dead_activations", timeout=90)[0]
    assert "module 3 (ReLU" in finding["message"]
    rows = json.loads(cli(job.pid, "query", "SELECT count(*) AS n FROM torch.syncs", "-f", "json").stdout)
    assert rows[0]["n"] == 0  # the statistics' reductions and copies never made the host wait
