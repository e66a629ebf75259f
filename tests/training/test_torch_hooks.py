"""The torch hooks never change training: in-place ReLU, several models and optimizers,
gradient accumulation, no_grad evaluation passes, sampling, a broken hook, probe.step()."""

from __future__ import annotations

import json
import re

import pytest

from conftest import TARGETS, requires_torch, run_target
from harness import query_json

pytestmark = requires_torch
LOOPS = TARGETS / "torch_loops.py"


def losses_of(lines) -> list[str]:
    return next(line for line in lines if line.startswith("losses ")).split()[1:]


def hooks_by_step(lines) -> dict[int, int]:
    return {
        int(m.group(1)): int(m.group(2))
        for m in (re.match(r"hooks step=(\d+) forward=(\d+)", line) for line in lines)
        if m
    }


def run_without_probe(probe_env, kind: str) -> list[str]:
    env = dict(probe_env, TARGET_NO_PROBE="1")
    out = run_target([LOOPS, "--kind", kind, "--steps", "12"], env)
    lines = out.stdout.splitlines()
    assert any(line.startswith("losses ") for line in lines), out.stderr
    return losses_of(lines)


@pytest.fixture
def reference(probe_env):
    return run_without_probe(probe_env, "inplace")


def test_inplace_relu_two_optimizers_accumulation_trains_unchanged(spawn, cli, reference):
    # given: the loop traced and measured at every step (the counts below are on every step: at the default budget a
    # loaded host's costlier boundaries spend the start-up credit within 12 steps, and some go uncounted)
    proc = spawn([LOOPS, "--kind", "inplace", "--steps", "12"], env={"PROBE_TRACE": "all", "PROBE_STEP_BUDGET": "off"})
    # then: the same losses as without the probe, and no error inside the probe
    assert losses_of(proc.lines) == reference
    assert query_json(cli, proc.pid, "SELECT source, message FROM probe.errors") == []
    steps = query_json(
        cli, proc.pid, "SELECT step, loss, lr, samples, micro_batches, optimizer, traced FROM torch.steps ORDER BY step"
    )
    # the first optimizer to step (Adam, the head's) leads: one row per loop iteration, not per optimizer
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert all(r["optimizer"] == "Adam" and r["lr"] == pytest.approx(0.01) and r["traced"] for r in steps)
    # two micro-batches of 16 per step; the no_grad evaluation pass is not counted
    assert all(r["micro_batches"] == 2 and r["samples"] == 32 for r in steps[1:])
    step_losses = [float(v) for v in next(line for line in proc.lines if line.startswith("step_losses ")).split()[1:]]
    assert [r["loss"] for r in steps] == pytest.approx(
        step_losses, rel=1e-6
    )  # the sum of the backpropagated (loss / 2)
    opts = query_json(
        cli,
        proc.pid,
        "SELECT optimizer, momentum, is_lead, step_count, state_bytes, elements "
        "FROM torch.optimizer ORDER BY optimizer",
    )
    assert [(o["optimizer"], o["is_lead"]) for o in opts] == [("Adam", True), ("SGD", False)]
    adam, sgd = opts
    assert adam["state_bytes"] == adam["elements"] * 8 + 2 * 4 and adam["step_count"] == 12
    assert sgd["momentum"] == pytest.approx(0.9) and sgd["state_bytes"] == sgd["elements"] * 4  # momentum buffers
    trace = query_json(
        cli, proc.pid, "SELECT DISTINCT model, module, depth FROM python.torch_trace WHERE stage = 'forward'"
    )
    assert {("encoder", "1", 1), ("head", "0", 1), ("encoder", "encoder", 0)} <= {
        (r["model"], r["module"], r["depth"]) for r in trace
    }


@pytest.mark.parametrize("trace", ["all", "5"])
def test_a_compiled_module_trains_unchanged_without_graph_breaks(spawn, cli, reference, trace):
    # given: the encoder compiled with fullgraph=True, so a hook dynamo cannot trace would raise
    proc = spawn([LOOPS, "--kind", "compiled", "--steps", "12"], env={"PROBE_TRACE": trace}, timeout=240)
    # then: training matches the uncompiled run and dynamo saw nothing to break on
    assert [float(v) for v in losses_of(proc.lines)] == pytest.approx([float(v) for v in reference], abs=1e-5)
    assert "graph_breaks 0" in proc.lines
    # the probe's warning filter is added once: the loop's own once-per-location warning stays once
    assert sum("UserWarning: the loop's own warning" in line for line in proc.lines) == 1
    assert query_json(cli, proc.pid, "SELECT source, message FROM probe.errors") == []
    steps = query_json(cli, proc.pid, "SELECT step, loss FROM torch.steps ORDER BY step")
    assert [r["step"] for r in steps] == list(range(1, 13))
    # the compiled encoder is one traced call (its inlined layers are not visible); the head's layers are
    rows = query_json(
        cli, proc.pid, "SELECT DISTINCT step, module, module_type FROM python.torch_trace WHERE stage = 'forward'"
    )
    assert {r["step"] for r in rows} == ({1, 2, 3, 5, 10} if trace == "5" else set(range(1, 13)))
    types = {r["module_type"] for r in rows}
    assert "OptimizedModule" in types and "Linear" in types
    # torch.compile's `_orig_mod` level is not part of a module's path: the eval pass's plain calls
    # of the encoder's layers are named as the user wrote them
    assert {("encoder_fwd", "OptimizedModule"), ("0", "Linear"), ("1", "ReLU")} <= {
        (r["module"], r["module_type"]) for r in rows
    }
    assert not any("_orig_mod" in r["module"] for r in rows)
    params = query_json(
        cli, proc.pid, "SELECT model, name FROM torch.parameters WHERE model = 'encoder_fwd' ORDER BY name"
    )
    assert [p["name"] for p in params] == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_sampled_steps_remove_every_hook_between_samples(spawn, cli):
    proc = spawn([LOOPS, "--kind", "inplace", "--steps", "12"], env={"PROBE_TRACE": "5"})
    sampled = {1, 2, 3, 5, 10}
    # the loop saw torch's global forward hooks only inside sampled steps
    assert {s for s, n in hooks_by_step(proc.lines).items() if n} == sampled
    assert all(n in (0, 1) for n in hooks_by_step(proc.lines).values())
    traced = query_json(cli, proc.pid, "SELECT DISTINCT step FROM python.torch_trace ORDER BY step")
    assert [r["step"] for r in traced] == sorted(sampled)
    flags = query_json(cli, proc.pid, "SELECT step FROM torch.steps WHERE traced ORDER BY step")
    assert [r["step"] for r in flags] == sorted(sampled)


def test_trace_off_installs_no_module_hook(spawn, cli):
    proc = spawn([LOOPS, "--kind", "inplace", "--steps", "6"], env={"PROBE_TRACE": "off"})
    assert set(hooks_by_step(proc.lines).values()) == {0}
    assert query_json(cli, proc.pid, "SELECT COUNT(*) AS n FROM python.torch_trace") == [{"n": 0}]
    assert query_json(cli, proc.pid, "SELECT COUNT(*) AS n FROM torch.steps") == [{"n": 6}]


def test_a_broken_hook_is_recorded_and_training_goes_on(spawn, cli, reference):
    proc = spawn([LOOPS, "--kind", "broken", "--steps", "12"])
    assert losses_of(proc.lines) == reference
    errors = query_json(cli, proc.pid, "SELECT source, message FROM probe.errors")
    assert errors and all("injected failure" in e["message"] for e in errors)
    assert {e["source"] for e in errors} == {"torch steps: loss", "torch steps: grad norm"}
    steps = query_json(cli, proc.pid, "SELECT step, loss, grad_norm, lr FROM torch.steps ORDER BY step")
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert all(r["loss"] is None and r["grad_norm"] is None and r["lr"] == pytest.approx(0.01) for r in steps)


def test_explicit_probe_step_without_an_optimizer(spawn, cli, probe_env):
    proc = spawn([LOOPS, "--kind", "explicit", "--steps", "8"])
    steps = query_json(cli, proc.pid, "SELECT step, loss, samples, samples_per_s, lr FROM torch.steps ORDER BY step")
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert [f"{r['loss']:.6f}" for r in steps] == losses_of(proc.lines)
    assert all(r["samples"] == 32 and r["samples_per_s"] > 0 and r["lr"] is None for r in steps)
    r = cli(proc.pid, "query", "SELECT step, state FROM process.info", "-f", "json")
    assert json.loads(r.stdout)[0] == {"step": 8, "state": "training"}


@requires_torch
def test_reading_the_loop_locals_keeps_nothing_alive_and_changes_nothing(probe_env):
    """The loss look-up reads the loop frame's locals each step; on 3.11/3.12 that snapshot must
    not keep the previous step's tensors alive, and the loop's variables must stay intact,
    also under a trace function (a debugger)."""

    def run(**env):
        e = dict(probe_env, **env)
        out = run_target([TARGETS / "torch_locals.py"], e)
        assert out.returncode == 0, out.stdout + out.stderr
        return dict(kv.split("=") for kv in out.stdout.split())

    plain = run(NO_PROBE="1")
    probed = run()
    traced = run(TRACE="1")
    assert plain["alive"] == "0" and probed["alive"] == "0"
    # a step function's frame is not kept past its boundary (it held the last step's logits through the next)
    assert run(NO_PROBE="1", STEP_FN="1")["alive_fn"] == run(STEP_FN="1")["alive_fn"] == "0"
    assert probed["total"] == plain["total"] == traced["total"]
    assert probed["checksum"] == plain["checksum"] == traced["checksum"] == "190"


def test_backward_rows_cut_the_pass_without_overlap(spawn, cli):
    """Two root models called one after the other (head(encoder(x))): each backward row runs from autograd
    reaching that root's output to reaching the next one's, so the rows never overlap (the head's row
    used to repeat the encoder's backward, and a loss module's row the whole pass)."""
    proc = spawn([LOOPS, "--kind", "inplace", "--steps", "4"], env={"PROBE_TRACE": "all"})
    rows = query_json(
        cli,
        proc.pid,
        "SELECT step, module, time, duration FROM python.torch_trace WHERE stage = 'backward' ORDER BY time",
    )
    import datetime

    for r in rows:
        r["time"] = datetime.datetime.fromisoformat(r["time"]).timestamp()
    assert {r["module"] for r in rows} == {"encoder", "head"}
    assert len(rows) == 4 * 2 * 2  # 4 steps, 2 micro-batches, 2 roots
    # On CPU `time` and `duration` come from one clock (perf_counter; the reading that ends one row starts the
    # next), but `time` is a TIMESTAMP: each start is cut to the microsecond, from an epoch in a double (~0.25 us).
    # So a row's end may pass the next row's start by the two starts' rounding, 2 us at most; a row that repeated
    # the next root's backward would pass it by that root's whole backward (every one is longer than that).
    resolution = 2e-6
    assert all(r["duration"] > resolution for r in rows), rows
    for a, b in zip(rows, rows[1:]):
        assert a["time"] + a["duration"] <= b["time"] + resolution, (a, b)
    heads = [r for r in rows if r["module"] == "head"]
    encs = [r for r in rows if r["module"] == "encoder"]
    assert all(h["time"] < e["time"] for h, e in zip(heads, encs))  # autograd reaches the head's output first
