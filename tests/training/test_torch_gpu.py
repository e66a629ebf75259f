"""probe on a CUDA device: every CUDA path run on the device, checked against what the job itself measures.

Run with `./run-tests --gpu` on a machine with a GPU (skipped elsewhere). The loop under test
(tests/targets/cuda_loop.py) never reads the device until its last step, so a host-device sync seen while it trains is
probe's. `PROBE_GPU_DRYRUN=1` runs, on the CPU, the tests whose logic does not need CUDA (the rest skip), to check
the tests themselves on a machine without a GPU.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from conftest import EXAMPLES, TARGETS, poll, requires_torch
from harness import query_json
from _doctor import doctor, poll_for


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


DEVICE = "cuda" if _cuda() else ("cpu" if os.environ.get("PROBE_GPU_DRYRUN") == "1" else None)
pytestmark = [
    requires_torch,
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (PROBE_GPU_DRYRUN=1 runs what can run on the CPU)"),
]
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
LOOP = TARGETS / "cuda_loop.py"
PROBE_DIR = str(Path(__import__("probe").__file__).resolve().parent) + os.sep


def _loop(spawn, *flags, env=None, ready="ready", timeout=240):
    return spawn(
        [LOOP, "--device", DEVICE, *map(str, flags)], env={"PROBE": "1", **(env or {})}, ready=ready, timeout=timeout
    )


def _report(job, path: Path, timeout: float = 300) -> dict:
    job.wait_for("done", timeout)
    return json.loads(path.read_text())


@cuda_only
def test_probe_adds_no_host_device_sync_while_its_tables_are_read(spawn, cli, tmp_path):
    # given: a loop that never syncs, under torch's sync debug mode, every sync warning kept with its stack
    rep = tmp_path / "r.json"
    job = _loop(spawn, "--sync-watch", "--steps", 3000, "--report", rep, "--linger", env={"PROBE_TRACE": "5"})
    # when: its loss, step time, memory and module traces are read again and again while it trains
    reads = 0
    while not any("done" in line for line in job.lines):
        for sql in (
            "SELECT step, loss, duration, grad_norm, memory FROM torch.steps ORDER BY step DESC LIMIT 20",
            "SELECT * FROM torch.memory",
            "SELECT module, stage, duration, allocated, out_mean FROM python.torch_trace ORDER BY step DESC LIMIT 50",
            "SELECT name, grad_norm, nan_count FROM torch.parameters",
        ):
            query_json(cli, job.pid, sql)
        doctor(cli, job.pid)
        reads += 1
    r = _report(job, rep)
    # then: the loop ran its steps, and not one sync came from a stack holding a frame of the probe
    assert r["last"] >= 200 and reads >= 2, (r["last"], reads)
    ours = [s for s in r["syncs"] if any(PROBE_DIR in f for f in s["stack"])]
    assert not ours, json.dumps(ours[:3], indent=1)
    steps = query_json(cli, job.pid, "SELECT count(*) AS n, count(loss) AS losses FROM torch.steps")[0]
    assert steps["n"] == r["last"] and steps["losses"] == r["last"], steps


def test_loss_on_every_step_equals_the_loops_own_and_durations_match_its_cuda_events(spawn, cli, tmp_path):
    rep = tmp_path / "r.json"
    size = ("--layers", 4, "--width", 256) if DEVICE == "cuda" else ()
    job = _loop(spawn, "--steps", 600, *size, "--report", rep, "--linger")
    r = _report(job, rep)

    def all_losses():
        rows = query_json(cli, job.pid, "SELECT step, loss, duration FROM torch.steps ORDER BY step")
        return rows if len(rows) == 600 and all(x["loss"] is not None for x in rows) else None

    rows = poll(all_losses, 30) or query_json(
        cli, job.pid, "SELECT step, loss, duration FROM torch.steps ORDER BY step"
    )
    assert [x["step"] for x in rows] == list(range(1, 601))
    for x, own in zip(rows, r["loss"]):
        assert x["loss"] is not None and abs(x["loss"] - own) <= 1e-5 * max(1.0, abs(own)), (x, own)
    if DEVICE == "cuda":  # wall-clock step times against the device's own clock, over the steady steps
        ours = sum(x["duration"] for x in rows[100:])
        theirs = sum(r["event_s"][100:])
        assert abs(ours / theirs - 1) <= 0.05, (ours, theirs)


@cuda_only
def test_memory_tables_match_the_allocator_a_leak_is_named_and_cleanup_returns_the_cache(spawn, cli):
    leaky = _loop(spawn, "--leak-mb", 4, "--layers", 4, "--width", 256)
    healthy = _loop(spawn, "--layers", 4, "--width", 256)
    # the allocator's own figures, read by the job, beside the table's (reserved is steady between steps)
    mem = query_json(cli, healthy.pid, "SELECT * FROM torch.memory WHERE device = 'cuda:0'")[0]
    own = cli(healthy.pid, "eval", "(torch.cuda.memory_allocated(), torch.cuda.memory_reserved())")
    allocated, reserved = json.loads(own.stdout.strip().replace("(", "[").replace(")", "]"))
    assert mem["reserved"] == reserved and 0 < mem["allocated"] <= mem["reserved"] <= mem["total"], (mem, own.stdout)
    assert abs(mem["allocated"] - allocated) <= 0.5 * reserved, (mem, allocated)
    # a leak of 4 MB a step is named within a minute; its healthy twin is quiet
    poll_for(cli, leaky.pid, "memory_growth", timeout=60)
    assert not [f for f in doctor(cli, healthy.pid)["findings"] if f["rule"] == "memory_growth"]
    # cleanup gives the allocator's cache back: the leak dropped, reserved memory goes down
    assert cli(leaky.pid, "eval", "leak.clear()").returncode == 0
    r = cli(leaky.pid, "--format", "json", "cleanup")
    result = json.loads(r.stdout)[0]["action"]["result"]
    assert result["after"]["cuda_reserved"] < result["before"]["cuda_reserved"], result


@cuda_only
def test_a_cuda_out_of_memory_error_leaves_a_record_with_the_memory_figures(spawn, cli):
    job = _loop(spawn, "--oom-at", 30)
    assert job.wait(120) != 0

    def row():
        listed = json.loads(cli("list", "--dead", "--json").stdout)
        return [x for x in listed if x["pid"] == job.pid]

    dead = poll(row, 60)
    assert dead and dead[0]["cause"] == "exception", dead
    assert "OutOfMemoryError" in json.dumps(dead[0]) or "out of memory" in json.dumps(dead[0]).lower(), dead
    mem = query_json(cli, job.pid, "SELECT * FROM torch.memory WHERE device = 'cuda:0'")
    assert mem and mem[0]["allocated"] > 0 and mem[0]["ooms"] >= 1, mem


def test_emergency_checkpoint_with_device_rng_resumes_at_the_same_loss(spawn, cli, tmp_path):
    ckpt = tmp_path / "ck.pt"
    job = _loop(spawn, "--print-every", 10)
    r = cli(job.pid, "--format", "json", "checkpoint", ckpt)
    assert r.returncode == 0, r.stdout + r.stderr
    step = json.loads(r.stdout)[0]["action"]["step"]

    def next_loss():
        rows = query_json(cli, job.pid, f"SELECT loss FROM torch.steps WHERE step = {step + 1}")
        return rows and rows[0]["loss"] is not None and rows[0]["loss"]

    expected = poll(next_loss, 30)
    assert expected, "the original job's next loss"
    rep = tmp_path / "resumed.json"
    again = spawn([LOOP, "--device", DEVICE, "--resume", ckpt, "--steps", 3, "--report", rep], ready="resumed")
    got = _report(again, rep)
    assert got["first"] == step + 1 and math.isclose(got["loss"][0], expected, rel_tol=1e-5), (got, expected)


@cuda_only
def test_torch_compile_with_inductor_recompiles_nothing_more_when_probed(spawn, cli, tmp_path):
    def run(probed: bool) -> dict:
        rep = tmp_path / f"c{int(probed)}.json"
        job = spawn(
            [LOOP, "--device", DEVICE, "--compile", "--steps", 400, "--report", rep, "--linger"],
            env={"PROBE": "1", "PROBE_TRACE": "all"} if probed else {},
            timeout=400,
        )
        while probed and not any("done" in line for line in job.lines):
            query_json(
                cli, job.pid, "SELECT module, stage, duration FROM python.torch_trace ORDER BY step DESC LIMIT 20"
            )
            query_json(cli, job.pid, "SELECT step, loss, grad_norm FROM torch.steps ORDER BY step DESC LIMIT 5")
        return _report(job, rep)

    plain, probed = run(False), run(True)
    assert probed["dynamo"] == plain["dynamo"], (plain["dynamo"], probed["dynamo"])
    assert probed["dynamo"]["graph_breaks"] == 0


@cuda_only
def test_profile_steps_holds_cuda_kernels_and_the_trace_device_durations(spawn, cli, tmp_path):
    job = _loop(spawn, env={"PROBE_TRACE": "all"})
    out = tmp_path / "prof.json"
    r = cli(job.pid, "profile-steps", "3", "-o", out)
    assert r.returncode == 0, r.stderr
    events = json.loads(out.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels and all(e.get("dur", 0) > 0 for e in kernels), sorted({e.get("cat") for e in events})
    t = tmp_path / "trace.json"
    assert cli(job.pid, "trace", "--steps", "5", "-o", t).returncode == 0
    timed = [e for e in json.loads(t.read_text())["traceEvents"] if e.get("ph") == "X" and e.get("dur", 0) > 0]
    assert timed, "module calls with their device durations"
    rows = query_json(cli, job.pid, "SELECT count(*) AS n, count(duration) AS timed FROM python.torch_trace")[0]
    assert rows["n"] > 0 and rows["timed"] > 0, rows


@cuda_only
def test_nccl_world_of_one_fsdp2_trains_checkpoints_and_shows_its_collectives(tmp_path):
    from _ranks import ddp_job

    ckpt = str(tmp_path / "ck-{rank}.pt")
    target = str(TARGETS / "fsdp2_train.py")
    with ddp_job(
        "--backend",
        "nccl",
        "--steps",
        "3000",
        "--step-sleep",
        "0.005",
        "--linger",
        world=1,
        target=target,
        torchrun=True,
    ) as job:
        c = job.cli("--ranks", "all", "--yes", "checkpoint", ckpt)
        assert c.returncode == 0, c.stdout + c.stderr
        r = job.cli("--ranks", "all", "--format", "json", "query", "SELECT backend, op, state FROM torch.collectives")
        coll = json.loads(r.stdout)
        assert coll and {x["backend"] for x in coll} == {"nccl"}, coll
        r = job.cli("--ranks", "all", "--format", "json", "query", "SELECT count(grad_norm) AS n FROM torch.steps")
        assert json.loads(r.stdout)[0]["n"] > 0
    assert Path(ckpt.format(rank=0)).stat().st_size > 0


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_losses_norms_and_a_scaler_that_skips(spawn, cli, tmp_path, amp):
    if DEVICE != "cuda" and amp == "fp16":
        pytest.skip("fp16 matrix products are emulated on the CPU: far too slow to dry-run")
    rep = tmp_path / "r.json"
    # under fp16, the scaler's scale is pushed to 2**40 before step 150: the gradients overflow and it skips updates
    job = _loop(spawn, "--amp", amp, "--steps", 400, "--overflow-at", 150, "--report", rep, "--linger")
    r = _report(job, rep)
    rows = query_json(cli, job.pid, "SELECT step, loss, grad_norm FROM torch.steps ORDER BY step")
    skipped = set(r["skipped"])
    if amp == "fp16":
        assert 150 in skipped, sorted(skipped)
    assert len(rows) == 400 - len(skipped), "a skipped update is not an optimizer step"
    # every update the loop applied has its loss and its unscaled gradient norm, as the loop computed them
    applied = [s for s in range(1, 401) if s not in skipped]
    for row, s in zip(rows, applied):
        own_loss, own_norm = r["loss"][s - 1], r["grad_norm"][s - 1]
        assert row["loss"] is not None and abs(row["loss"] - own_loss) <= 1e-5 * max(1.0, abs(own_loss)), (s, row)
        if row["grad_norm"] is not None:
            assert math.isclose(row["grad_norm"], own_norm, rel_tol=1e-4), (s, row, own_norm)
    assert any(row["grad_norm"] is not None for row in rows)
    # overflowing scaled gradients are the scaler's business: no NaN/inf finding
    findings = {f["rule"] for f in doctor(cli, job.pid)["findings"]}
    assert not findings & {"loss_nonfinite", "grad_nonfinite", "params_nonfinite"}, findings


@cuda_only
def test_cuda_trace_durations_and_memory(spawn, cli):
    proc = spawn([EXAMPLES / "train_gpt.py", "--print-every", "10", "--device", "cuda"], env={"PROBE_TRACE": "all"})
    proc.wait_for("step 20 ")

    def traced() -> list:  # durations appear once the CUDA events have completed
        rows = query_json(
            cli, proc.pid, "SELECT step, module, stage, duration, allocated FROM python.torch_trace WHERE step <= 10"
        )
        return rows if rows and all(x["duration"] is not None for x in rows) else []

    rows = poll(traced, 30)
    assert rows and all(x["duration"] is not None and x["duration"] > 0 for x in rows)
    assert all(x["allocated"] > 0 for x in rows)  # CUDA allocated bytes, not RSS
    steps = query_json(cli, proc.pid, "SELECT step, loss, peak_allocated FROM torch.steps WHERE step <= 10")
    assert all(math.isfinite(s["loss"]) and s["peak_allocated"] > 0 for s in steps)
    mem = query_json(cli, proc.pid, "SELECT * FROM torch.memory WHERE device = 'cuda:0'")
    assert mem and mem[0]["allocated"] > 0 and mem[0]["total"] > 0


@cuda_only
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
    assert query_json(cli, job.pid, "SELECT origin, via, count FROM torch.syncs WHERE origin = 'probe'") == []


@cuda_only
def test_cuda_output_statistics_land_without_a_sync(spawn, cli):
    job = spawn(
        [TARGETS / "faults.py", "--fault", "dead_relu", "--device", "cuda", "--settle", "30"],
        env={"PROBE": "1", "PROBE_TRACE": "5"},
        ready="planted",
        timeout=180,
    )
    finding = poll_for(cli, job.pid, "dead_activations", timeout=90)[0]
    assert "module 3 (ReLU" in finding["message"]
    assert query_json(cli, job.pid, "SELECT count(*) AS n FROM torch.syncs")[0]["n"] == 0
