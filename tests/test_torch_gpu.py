"""The CUDA path: device-time durations from CUDA events, filled in lazily; loss read without a sync."""

from __future__ import annotations

import json
import math
import time

import pytest

from conftest import EXAMPLES, requires_torch


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
    deadline = time.monotonic() + 30
    while True:  # durations appear once the CUDA events have completed
        r = cli(proc.pid, "query", "SELECT step, module, stage, duration, allocated FROM python.torch_trace WHERE step <= 10", "-f", "json")
        rows = json.loads(r.stdout)
        if rows and all(x["duration"] is not None for x in rows) or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # ok-sleep: polling with a deadline
    assert rows and all(x["duration"] is not None and x["duration"] > 0 for x in rows)
    assert all(x["allocated"] > 0 for x in rows)  # CUDA allocated bytes, not RSS
    r = cli(proc.pid, "query", "SELECT step, loss, peak_allocated FROM torch.steps WHERE step <= 10", "-f", "json")
    steps = json.loads(r.stdout)
    assert all(math.isfinite(s["loss"]) and s["peak_allocated"] > 0 for s in steps)
    mem = json.loads(cli(proc.pid, "query", "SELECT * FROM torch.memory WHERE device = 'cuda:0'", "-f", "json").stdout)
    assert mem and mem[0]["allocated"] > 0 and mem[0]["total"] > 0
