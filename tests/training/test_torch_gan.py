"""Several optimizers in one iteration (a GAN), under plain PROBE=1 with no probe code: a step ends after
the iteration's last optimizer step, each optimizer keeps its own loss and lr, actions run after both, and
`lr` applies to both and checks both."""

from __future__ import annotations

import json
import re
import signal

import pytest

from conftest import TARGETS, poll, requires_torch
from harness import query_json

pytestmark = requires_torch
GAN = TARGETS / "gan_loop.py"
_ITER = re.compile(r"iter (\d+) d_loss (\S+) g_loss (\S+) d_lr \S+ d_used (\S+) g_lr \S+ g_used (\S+)")


def _iters(p) -> dict[int, tuple[float, ...]]:
    """What the loop printed: iteration -> (d_loss, g_loss, d_used, g_used)."""
    out = {}
    for line in list(p.lines):
        m = _ITER.match(line)
        if m:
            out[int(m.group(1))] = tuple(float(x) for x in m.groups()[1:])
    return out


def test_a_step_holds_one_iteration_of_both_optimizers(spawn, cli):
    # a budget that measures few steps: each optimizer's loss is on every step all the same
    p = spawn([GAN, "--step-sleep", "0.005"], env={"PROBE": "1", "PROBE_STEP_BUDGET": "0.0001"})
    p.wait_for("iter 30 ")
    # given: the optimizers, named as the finder knows them
    opts = query_json(cli, p.pid, "SELECT name, is_lead FROM torch.optimizer ORDER BY name")
    assert [(o["name"], o["is_lead"]) for o in opts] == [("opt_d", True), ("opt_g", False)]
    # when: each optimizer's rows of the iterations the loop printed
    rows = query_json(
        cli,
        p.pid,
        "SELECT step, position, optimizer, loss, lr FROM torch.optimizer_steps "
        "WHERE loss IS NOT NULL AND step <= 25 ORDER BY step, position",
    )
    iters = _iters(p)
    by_step: dict[int, dict] = {}
    for r in rows:
        by_step.setdefault(r["step"], {})[r["optimizer"]] = r
    both = {s: v for s, v in by_step.items() if set(v) == {"opt_d", "opt_g"}}
    # every step from the one the iteration was recognised at carries both losses: core signals, never sampled
    assert len(both) >= 10 and sorted(both) == list(range(min(both), 26)), rows
    # then: D's and G's losses of one step are those of one iteration (never D's with G's previous), in order
    offsets = set()
    for s, v in both.items():
        assert v["opt_d"]["position"] == 0 and v["opt_g"]["position"] == 1
        assert v["opt_d"]["lr"] == pytest.approx(0.02) and v["opt_g"]["lr"] == pytest.approx(0.01)
        it = next(i for i, vals in iters.items() if vals[0] == pytest.approx(v["opt_d"]["loss"], rel=1e-6))
        assert iters[it][1] == pytest.approx(v["opt_g"]["loss"], rel=1e-6), (s, it)
        offsets.add(s - it)
    assert len(offsets) == 1, offsets
    # torch.steps: the step's loss is what the iteration backpropagated (D's and G's, summed)
    steps = {r["step"]: r for r in query_json(cli, p.pid, "SELECT step, loss FROM torch.steps WHERE step <= 25")}
    for s, v in both.items():
        if steps[s]["loss"] is not None:
            assert steps[s]["loss"] == pytest.approx(v["opt_d"]["loss"] + v["opt_g"]["loss"], rel=1e-5)
    # and an action runs after both optimizers of the iteration, never between them
    for _ in range(3):
        r = cli(p.pid, "eval", "--at-step", 'stepped["d"] - stepped["g"]')
        assert r.returncode == 0 and r.stdout.strip() == "0", (r.stdout, r.stderr)


def test_each_step_holds_the_losses_of_its_own_iteration_from_the_first(spawn, cli):
    # given: the GAN at probe's defaults, its first iterations stepped before probe knew there were two optimizers
    p = spawn([GAN, "--step-sleep", "0.005"], env={"PROBE": "1"})
    p.wait_for("iter 30 ")
    iters = _iters(p)
    # when: torch.steps' loss of the first 25 steps
    steps = query_json(cli, p.pid, "SELECT step, loss FROM torch.steps WHERE step <= 25 ORDER BY step")
    # then: step N holds what iteration N backpropagated, D's and G's, from step 1 on (none a step late, none lost)
    assert [r["step"] for r in steps] == list(range(1, 26)), steps
    for r in steps:
        d_loss, g_loss = iters[r["step"]][:2]
        assert r["loss"] == pytest.approx(d_loss + g_loss, rel=1e-5), (r, iters[r["step"]])


def test_lr_applies_to_both_optimizers_and_checks_both(spawn, cli):
    p = spawn([GAN, "--step-sleep", "0.005"], env={"PROBE": "1"})
    p.wait_for("iter 5 ")
    # when: no --optimizer with two optimizers
    r = cli(p.pid, "lr", "--scale", "0.5")
    # then: done only once both have stepped with the new rates
    assert r.returncode == 0, r.stderr
    assert re.search(r"'opt_d'.*\n\s+group 0: 0\.02 -> 0\.01; step \d+ used 0\.01\b", r.stdout), r.stdout
    assert re.search(r"'opt_g'.*\n\s+group 0: 0\.01 -> 0\.005; step \d+ used 0\.005\b", r.stdout), r.stdout
    # and the updates the loop measures use them
    seen = poll(
        lambda: [
            v
            for v in _iters(p).values()
            if v[2] == pytest.approx(0.01, rel=1e-3) and v[3] == pytest.approx(0.005, rel=1e-3)
        ]
    )
    assert seen, p.output()[-2000:]
    # --optimizer takes the name torch.optimizer shows
    r = cli(p.pid, "lr", "--scale", "0.5", "--optimizer", "opt_g")
    assert (
        r.returncode == 0
        and "opt_d" not in r.stdout
        and re.search(r"0\.005 -> 0\.0025; step \d+ used 0\.0025", r.stdout)
    ), r
    assert poll(
        lambda: [
            v
            for v in _iters(p).values()
            if v[2] == pytest.approx(0.01, rel=1e-3) and v[3] == pytest.approx(0.0025, rel=1e-3)
        ]
    )
    r = cli(p.pid, "lr", "--reset", "--optimizer", "1")
    assert r.returncode == 0 and "opt_g" in r.stdout and "opt_d" not in r.stdout, r
    r = cli(p.pid, "lr", "--set", "0.1", "--optimizer", "opt_x")
    assert r.returncode == 5 and "opt_x" in r.stderr and "0 opt_d, 1 opt_g" in r.stderr and "Traceback" not in r.stderr


def test_watching_the_last_optimizer_gives_the_same_iteration(spawn, cli):
    # given: the generator's optimizer named by probe.watch before anything stepped (the discriminator steps first)
    p = spawn([GAN, "--step-sleep", "0.005", "--watch-g"], env={"PROBE": "1"})
    p.wait_for("iter 12 ")
    rows = query_json(cli, p.pid, "SELECT DISTINCT optimizer, position FROM torch.optimizer_steps ORDER BY position")
    assert [(r["optimizer"], r["position"]) for r in rows] == [("opt_d", 0), ("opt_g", 1)]
    lead = query_json(cli, p.pid, "SELECT name FROM torch.optimizer WHERE is_lead")
    assert lead == [{"name": "opt_g"}]
    for _ in range(2):
        r = cli(p.pid, "eval", "--at-step", 'stepped["d"] - stepped["g"]')
        assert r.returncode == 0 and r.stdout.strip() == "0", (r.stdout, r.stderr)


def test_a_stopped_gan_keeps_each_optimizers_steps_in_its_record(spawn, cli):
    # given: a GAN training under PROBE=1, past the iterations where its cycle is recognised
    p = spawn([GAN, "--step-sleep", "0.005"], env={"PROBE": "1", "PROBE_POSTMORTEM_EVERY": "0"})
    p.wait_for("iter 30 ")
    # when: it is stopped as schedulers do
    p.popen.send_signal(signal.SIGTERM)
    p.popen.wait(30)
    # then: the dead pid still answers with each optimizer's rows, their losses those the loop printed
    listed = poll(lambda: [r for r in json.loads(cli("list", "--dead", "--json").stdout) if r["pid"] == p.pid], 60)
    assert listed and listed[0]["cause"] == "terminated", listed
    rows = query_json(
        cli, p.pid, "SELECT optimizer, count(*) AS n, count(loss) AS losses FROM torch.optimizer_steps GROUP BY ALL"
    )
    by_opt = {r["optimizer"]: r for r in rows}
    assert set(by_opt) == {"opt_d", "opt_g"}, rows
    assert all(r["n"] >= 20 and r["losses"] == r["n"] for r in rows), rows
    printed = {round(v[0], 5) for v in _iters(p).values()}
    kept = query_json(
        cli, p.pid, "SELECT loss FROM torch.optimizer_steps WHERE optimizer = 'opt_d' AND loss IS NOT NULL"
    )
    assert len({round(r["loss"], 5) for r in kept} & printed) >= 20, (kept[:5], sorted(printed)[:5])
