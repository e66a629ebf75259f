"""Real training frameworks and hand-written loops, run as users run them (PROBE=1, no probe code).

One process per loop, shared by the tests of this file (module-scoped): transformers' Trainer,
Lightning, an accelerate loop, and hand-written loops (a schedule assigned by hand every
iteration with gradient accumulation, AMP's scaler.scale(loss).backward(), optimizer.step(closure)).
Every target prints ``step N loss X lr Y used Z``: the loss and lr the loop or framework itself
logs for step N, and the lr step N really used, measured from the parameter update (plain SGD).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import pytest

from conftest import TARGETS, has_torch, run_target
from harness import clean_env, poll, run_probe, start, stop_groups


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


pytestmark = pytest.mark.skipif(
    not (has_torch() and _has("transformers") and _has("lightning") and _has("accelerate")),
    reason="transformers, lightning and accelerate are not installed",
)

LOOPS = {
    # name: (script args, optimizer rows: (class, wrapper, scheduler) per group)
    "hf": (["hf_trainer.py"], [("SGD", "AcceleratedOptimizer", "LambdaLR")] * 2),
    "lightning": (["lightning_train.py"], [("SGD", "LightningSGD", "LambdaLR")]),
    "accelerate": (["manual_lr_loop.py", "--kind", "accelerate"], [("SGD", "AcceleratedOptimizer", "LambdaLR")]),
    "manual": (["manual_lr_loop.py", "--kind", "manual"], [("SGD", None, None)]),
    "amp": (["manual_lr_loop.py", "--kind", "amp"], [("SGD", None, None)]),
    "closure": (["manual_lr_loop.py", "--kind", "closure"], [("SGD", None, None)]),
}
# Loops that run under a budget far below the probe's fixed cost (the optional values measured about once a second):
# HF Trainer, Lightning, AMP's scaled loss and a closure must still have the loss the loop logs on every step. The
# other loops run at the default budget.
BUDGETED = ("hf", "lightning", "amp", "closure")
LINE = re.compile(r"^(?:hf |pl )?step (\d+) loss (\S+) lr (\S+) used (\S+)")


class Loop:
    def __init__(self, name: str, extra_env: dict | None = None):
        self.name = name
        env = clean_env(PROBE="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        self.rt = env["PROBE_RUNTIME_DIR"]
        env.update(extra_env or {})
        self.env = env
        # paced: the tests need a few dozen steps, and a loop stepping flat out (a framework's ~1 ms steps)
        # takes a core from the `probe` calls they wait on for as long as the module runs
        args = [sys.executable, str(TARGETS / LOOPS[name][0][0]), *LOOPS[name][0][1:], "--step-sleep", "0.01"]
        if name in ("hf", "lightning"):
            args += ["--out", self.rt]
        self.proc = start(args, env, ready=None)
        self.popen, self.lines, self.pid = self.proc.popen, self.proc.lines, self.proc.pid
        self.proc.wait_for("ready", 120)

    def steps(self) -> dict[int, dict]:
        out = {}
        for line in list(self.lines):
            m = LINE.match(line)
            if m:
                out[int(m.group(1))] = {"loss": float(m.group(2)), "lr": float(m.group(3)), "used": float(m.group(4))}
        return out

    def wait_step(self, n: int) -> dict[int, dict]:
        self.proc.wait_for(f"step {n} ", 120)
        return self.steps()

    def wait_new(self, pattern: str, start: int, timeout: float = 60.0) -> str:
        """The first line printed after line ``start`` that matches ``pattern`` (polled with a deadline)."""
        return self.proc.wait_line(
            lambda line: re.match(pattern, line), f"a line matching {pattern!r}", start=start, timeout=timeout
        )

    def cli(self, *args, timeout: float = 60.0):
        return run_probe(self.pid, *args, env={k: v for k, v in self.env.items() if k != "PROBE"}, timeout=timeout)

    def query(self, sql: str) -> list[dict]:
        r = self.cli("query", sql, "--format", "json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def stop(self) -> None:
        stop_groups([self.popen], grace=10)
        shutil.rmtree(self.rt, ignore_errors=True)


@pytest.fixture(scope="module", params=list(LOOPS))
def loop(request):
    lp = Loop(request.param, extra_env={"PROBE_STEP_BUDGET": "0.00001"} if request.param in BUDGETED else None)
    yield lp
    lp.stop()


def test_loss_is_what_the_loop_logs(loop):
    logged = loop.wait_step(8)
    rows = loop.query("SELECT step, loss FROM torch.steps WHERE step BETWEEN 2 AND 7 ORDER BY step")
    assert [r["step"] for r in rows] == list(range(2, 8))
    for r in rows:
        assert r["loss"] == pytest.approx(logged[r["step"]]["loss"], rel=1e-5), (loop.name, r["step"])
    assert loop.query("SELECT source, message FROM probe.errors") == []


def test_every_logged_loss_is_in_torch_steps(loop):
    """Every step the framework or loop logged has its loss in torch.steps, to 1e-5, and >= 99 % of all steps
    carry one (the loss is a core signal: the budget does not sample it), the budgeted loops' too, though most of
    their steps were not measured."""
    logged = loop.wait_step(60)
    rows = loop.query("SELECT step, loss, measured FROM torch.steps WHERE step <= 60 ORDER BY step")
    assert [r["step"] for r in rows] == list(range(1, 61))
    assert sum(r["loss"] is not None for r in rows) >= 0.99 * 60
    if loop.name in BUDGETED:
        assert sum(not r["measured"] for r in rows) >= 20, rows  # most steps were not measured...
    for r in rows:  # ...and each has the loss the framework logged
        assert r["loss"] == pytest.approx(logged[r["step"]]["loss"], rel=1e-5), (loop.name, r)


def test_one_row_per_param_group_with_its_scheduler(loop):
    rows = loop.query(
        "SELECT optimizer, wrapper, scheduler, param_group, is_lead FROM torch.optimizer ORDER BY param_group"
    )
    assert [(r["optimizer"], r["wrapper"], r["scheduler"]) for r in rows] == LOOPS[loop.name][1]
    assert [r["param_group"] for r in rows] == list(range(len(rows))) and all(r["is_lead"] for r in rows)


# "used" is measured from float32 updates, -(dp . g) / (g . g): once a schedule has decayed the rate, p + dp
# rounds dp to ~1e-4 of itself; the override halves the rate, so 1e-3 still tells the two apart 500 times over
USED_REL = 1e-3
SCHEDULED = ("hf", "lightning", "accelerate")  # a torch LR scheduler drives the rate: `lr` scales its base rates


def test_lr_scale_holds_through_the_schedule_and_reset_ends_it(loop):
    # past the HF Trainer's 5 warm-up steps, whose rising rate the comparison with step first - 2 below cannot
    # allow for (on a quiet host the change otherwise lands at step 3 or 4)
    loop.wait_step(8)
    r = loop.cli("lr", "--scale", "0.5")
    assert r.returncode == 0, r.stderr
    reset = None
    try:
        first = int(re.search(r"from step (\d+)", r.stdout).group(1))
        assert re.search(rf"group 0: \S+ -> \S+; step {first} used \S+", r.stdout), (
            r.stdout
        )  # seen used before the reply
        logged = loop.wait_step(first + 6)
        rows = loop.query(f"SELECT step, lr FROM torch.steps WHERE step BETWEEN {first} AND {first + 5} ORDER BY step")
        assert [x["lr"] for x in rows] == pytest.approx(
            [logged[s]["used"] for s in range(first, first + 6)], rel=USED_REL
        )
        opt = loop.query(
            "SELECT lr, loop_lr, lr_override, lr_override_status FROM torch.optimizer WHERE param_group = 0"
        )[0]
        (action,) = loop.query("SELECT state, result FROM probe.actions WHERE command = 'lr'")
        status = json.loads(action["result"])["optimizers"][0]["groups"][0]["status"]
        if loop.name in SCHEDULED:
            # a torch scheduler drives the rate: its base rate is halved, so the scheduler's own lr (what the
            # loop logs) is the rate in effect, half of what it was
            assert "through its scheduler's base rates" in r.stdout, r.stdout
            for s in range(first + 1, first + 6):
                assert logged[s]["used"] == pytest.approx(logged[s]["lr"], rel=USED_REL), (loop.name, s, logged[s])
            assert logged[first + 1]["lr"] == pytest.approx(0.5 * logged[first - 2]["lr"], rel=0.05), logged
            assert opt["lr_override"] == "scale 0.5 (scheduler base)" and opt["lr"] == opt["loop_lr"], opt
            assert action["state"] == "done" and "the scheduler computes from the scaled base rate" in status, status
            if loop.name == "lightning":  # param_groups read in on_train_batch_end: the rate in effect
                pg = {
                    int(m.group(1)): float(m.group(2))
                    for m in (re.match(r"pl pg (\d+) (\S+)", line) for line in loop.lines)
                    if m
                }
                for s in range(first + 1, first + 5):
                    assert pg[s] == pytest.approx(logged[s]["used"], rel=0.02) or pg[s] == pytest.approx(
                        logged[s + 1]["used"], rel=0.02
                    ), (s, pg[s], logged[s])
        else:
            if loop.name == "manual":  # its own code assigns the rate every step: the reply says who rewrites it
                assert "held at every step (the loop rewrites the rate" in r.stdout, r.stdout
            else:  # AMP's and the closure's loops never write their rate: the change is simply kept
                assert "kept: nothing rewrote the loop's rate" in r.stdout and "rewrites the rate;" not in r.stdout, (
                    r.stdout
                )
            for s in range(first, first + 6):
                # the loop sets its lr (its own code) every step; each step still used half of it
                assert logged[s]["used"] == pytest.approx(0.5 * logged[s]["lr"], rel=USED_REL), (
                    loop.name,
                    s,
                    logged[s],
                )
            assert opt["lr_override"] == "scale 0.5" and opt["lr"] == pytest.approx(0.5 * opt["loop_lr"])
            assert action["state"] == "done" and re.match(r"held for \d+ step", status), status
            if loop.name == "manual":  # a schedule assigned by hand rewrites the lr every step: said where
                assert re.search(r"re-applied because the loop rewrote lr at step \d+", status), status
        reset = loop.cli("lr", "--reset")
    finally:  # the job is shared with the file's other tests: never leave it running at half its rate
        reset = reset or loop.cli("lr", "--reset")
    assert reset.returncode == 0 and "removed scale 0.5" in reset.stdout, reset.stderr
    after = int(re.search(r"applies from step (\d+)", reset.stdout).group(1))
    logged = loop.wait_step(after + 2)
    assert [logged[s]["used"] for s in (after, after + 1)] == pytest.approx(
        [logged[s]["lr"] for s in (after, after + 1)], rel=USED_REL
    )


def test_eval_at_step_sees_the_loop_and_the_framework_objects(loop):
    r = loop.cli(
        "eval",
        "--at-step",
        "print(sorted(n for n in ('trainer', 'model', 'optimizer', 'scheduler', 'step', 'accelerator', 'targs', "
        "'loader') if n in globals()))",
    )
    assert r.returncode == 0, r.stderr
    names = eval(r.stdout.strip().splitlines()[-1])
    # targs, loader and step are locals of the script's own function that runs the loop (or calls fit/train)
    want = {
        "hf": {"trainer", "model", "optimizer", "scheduler", "targs"},
        "lightning": {"trainer", "model", "optimizer", "scheduler", "loader"},
        "accelerate": {"accelerator", "model", "optimizer", "scheduler", "step"},
    }.get(loop.name, {"model", "optimizer", "step"})
    assert want <= set(names), (loop.name, names, r.stdout)


def test_trainer_resumes_from_a_probe_checkpoint_file_to_the_same_next_steps(loop, tmp_path):
    """Checkpoint the running Lightning or transformers job with `probe checkpoint`, start it again
    from the file with probe.load_checkpoint(path, trainer=trainer): its next steps have the same
    step numbers, losses and learning rates as the first run's (before any test sets its state back)."""
    if loop.name not in ("hf", "lightning"):
        pytest.skip("the Trainers only: the other loops are resumed in-process by the checkpoint test")
    r = loop.cli("checkpoint", str(tmp_path / "ck-{step}.pt"))
    assert r.returncode == 0, r.stderr
    saved = re.search(r"wrote (\S+)", r.stdout).group(1).rstrip(":")
    step = int(re.search(r"ck-(\d+)\.pt", saved).group(1))
    want = loop.wait_step(step + 3)
    env = clean_env(str(tmp_path), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    # Lightning's schedule does not depend on the run's length; the Trainer's linear one does: keep it, stop early
    stop = ["--max-steps", str(step + 2)] if loop.name == "lightning" else ["--stop-at", str(step + 2)]
    out = run_target(
        [TARGETS / LOOPS[loop.name][0][0], "--out", tmp_path, "--resume", saved, "--skip", step, *stop],
        env,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"resumed from step {step} global_step {step}" in out.stdout, out.stdout
    got = {
        int(m.group(1)): {"loss": float(m.group(2)), "used": float(m.group(4))}
        for m in map(LINE.match, out.stdout.splitlines())
        if m
    }
    assert min(got) == step + 1  # the Trainer counts on from the checkpoint
    for s in (step + 1, step + 2):  # the weights (the loss of step + 1) and the scheduler (the lr step + 1 used)
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-6), s
        assert got[s]["used"] == pytest.approx(want[s]["used"], rel=1e-5), s


def test_checkpoint_has_the_scheduler_and_step_counters_and_loads_back(loop):
    path = os.path.join(loop.rt, "ck-{step}.pt")
    if (
        loop.name == "accelerate"
    ):  # the Accelerator's step (accumulate's counter; this loop does not use it): not 0, to see it saved
        r = loop.cli("eval", "--at-step", "accelerator.step = 3")
        assert r.returncode == 0, r.stderr
    r = loop.cli("checkpoint", path)
    assert r.returncode == 0, r.stderr
    saved = re.search(r"wrote (\S+)", r.stdout).group(1).rstrip(":")
    import torch

    state = torch.load(saved, weights_only=True)
    step = state["step"]
    if LOOPS[loop.name][1][0][2] is not None:  # a scheduler: saved, at the step the weights are at
        sched = state["scheduler"]
        assert sched["last_epoch"] + (1 if state["scheduler_step_pending"] else 0) == step
    if loop.name in ("hf", "lightning"):
        (counters,) = state["frameworks"].values()  # one entry: the HF Trainer's own Accelerator is not saved apart
        assert counters["global_step"] == step  # the Trainer's own count, the step in progress included
    if loop.name == "accelerate":
        assert list(state["frameworks"].values()) == [{"step": 3}], state["frameworks"]
    loop.wait_step(step + 3)  # restore a few steps later, so a step counter set back is visible
    # counters moved away from the saved ones before loading, so that loading visibly sets them back
    away = {
        "lightning": "ep = trainer.fit_loop.epoch_progress\n"
        "for t in (ep.total, ep.current):\n"
        "    for k in ('ready', 'started', 'processed', 'completed'): setattr(t, k, getattr(t, k) + 2)\n",
        "accelerate": "accelerator.step = 9\n",
    }.get(loop.name, "")
    after = {
        "lightning": "ep = trainer.fit_loop.epoch_progress.current\n"
        "print('counters', trainer.current_epoch, ep.ready - ep.completed)\n",
        "accelerate": "print('counters', accelerator.step)\n",
    }.get(loop.name, "")
    code = (
        f"import probe\nfw = globals().get('trainer') or globals().get('accelerator')\n{away}"
        f"st = probe.load_checkpoint({saved!r}, trainer=fw) if fw is not None else "
        f"probe.load_checkpoint({saved!r}, model=model, optimizer=optimizer)\n"
        "sd = st['model']\n"
        "print('diff', max(float((v - sd[k]).abs().max()) for k, v in model.state_dict().items()))\n" + after
    )
    r = loop.cli("eval", "--at-step", code)
    assert r.returncode == 0, r.stderr
    assert "diff 0.0" in r.stdout, r.stdout  # the weights are back
    if loop.name == "lightning":  # the epoch is back, still in progress (ready one ahead of completed)
        assert f"counters {state['frameworks']['trainer']['current_epoch']} 1" in r.stdout, r.stdout
    if loop.name == "accelerate":
        assert "counters 3" in r.stdout, r.stdout
    if loop.name in ("hf", "lightning"):
        # the Trainer counts on from the checkpoint's step: its next step is step + 1 again
        def back_to_step_after_checkpoint() -> bool:
            seen = [
                int(m.group(2)) for m in (re.match(r"(hf |pl )step (\d+) ", line) for line in list(loop.lines)) if m
            ]
            return any(n == step + 1 and max(seen[:i], default=0) > step + 2 for i, n in enumerate(seen))

        assert poll(back_to_step_after_checkpoint, 60, interval=0.02), loop.lines[-10:]
