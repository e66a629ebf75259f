"""`probe guard` and PROBE_GUARD against real training processes: a poisoned batch, a spike, a rollback, two DDP
ranks, FSDP2's refusal, HF Trainer and Lightning jobs, the page, refusals, and taking the guard out."""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.request

import pytest

from conftest import PROBE_BIN, TARGETS, requires_torch
from harness import start, stop_groups
from _ranks import ddp_job

pytestmark = requires_torch
TRAIN = TARGETS / "guard_train.py"


def _digests(proc, kind: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for line in proc.lines if (m := re.match(rf"iter (\d+) {kind} (\w+)", line))}


def _triggers(cli, pid) -> list[dict]:
    r = cli(pid, "--format", "json", "guard")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)[0]["caught"]


def test_a_poisoned_batch_is_skipped_and_its_evidence_replays_the_nan_offline(spawn, cli, tmp_path):
    # given: a job armed from the start, fed one batch with an inf in it
    evidence = tmp_path / "evidence"
    p = spawn(
        [TRAIN, "--poison-at", "12", "--steps", "20"],
        env={"PROBE_GUARD": f"nonfinite,keep=2,skip,evidence={evidence}"},
    )
    # then: it trains on with finite weights, and the poisoned step did not change them
    assert "finite=True" in p.wait_for("finished")
    pre, post = _digests(p, "pre"), _digests(p, "post")
    assert pre[12] == post[12] and pre[13] != post[13]
    caught = _triggers(cli, p.pid)
    assert len(caught) == 1 and caught[0]["taken"] == "skipped the update", caught
    assert "non-finite" in caught[0]["reason"]
    assert caught[0]["first_nonfinite"] == "0"  # the first Linear, found in the job by running the batch again
    shown = cli(p.pid, "guard")
    assert "armed --on nonfinite --keep 2 --skip" in shown.stdout and "caught 1" in shown.stdout, shown.stdout
    doctor = cli(p.pid, "doctor")
    assert "nan/guard_caught" in doctor.stdout and caught[0]["evidence"] in doctor.stdout, doctor.stdout
    # and: its evidence holds that batch and replays the NaN offline, on a model built as the job's
    import torch

    import probe

    ev = probe.load_evidence(str(evidence))
    assert ev.path == caught[0]["evidence"]
    assert [b["step"] for b in ev.batches] == [ev.step - 1, ev.step]  # --keep 2: the step before it, then it
    ((args, kwargs),) = ev.batch
    assert torch.isinf(args[0]).any() and not torch.isinf(ev.batches[0]["calls"][0][0][0]).any()
    assert not torch.isfinite(torch.tensor(ev.grad_norm)) and ev.lr == [0.01] and "0.weight" in ev.grad_norms
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    replay = ev.replay(model)
    assert replay.first_nonfinite == ev.first_nonfinite == "0" and not replay.finite
    assert not torch.isfinite(replay.outputs[0]).all()


def test_a_spike_from_one_huge_loss_batch_is_skipped(spawn, cli, tmp_path):
    flag = tmp_path / "spike"
    p = spawn([TRAIN, "--spike-file", flag])
    r = cli(p.pid, "guard", "--on", "spike=20", "--skip")
    assert r.returncode == 0, r.stderr
    assert re.search(r"guard armed at step \d+: --on spike=20 --keep 1 --skip on optimizer", r.stdout), r.stdout
    assert "holds up to" in r.stdout
    start = len(p.lines)
    p.wait_match(r"iter \d+ post", start=start, count=12)  # a history for the median
    flag.write_text("")
    i = int(p.wait_for("spiked at").split()[-1])
    p.wait_for(f"iter {i + 2} post")
    assert _digests(p, "pre")[i] == _digests(p, "post")[i]  # the update was not applied
    assert _digests(p, "pre")[i + 1] != _digests(p, "post")[i + 1]  # and training went on
    (caught,) = _triggers(cli, p.pid)
    assert caught["taken"] == "skipped the update" and "gradient norm" in caught["reason"], caught
    assert caught["grad_norm"] > 20 * caught["median"]


def test_rollback_restores_the_state_before_the_step_bit_for_bit(spawn, cli):
    # given: the weights go bad between two steps (an inf written into them)
    p = spawn([TRAIN, "--break-at", "10", "--steps", "16"], env={"PROBE_GUARD": "nonfinite,keep=0,rollback"})
    assert "finite=True" in p.wait_for("finished")
    (caught,) = _triggers(cli, p.pid)
    assert caught["taken"] == "skipped the update; rolled back to the state before step 9", caught
    # then: the next step starts from the weights and momentum before step 9's update, bit for bit
    assert _digests(p, "start")[11] == _digests(p, "pre")[9]


def test_guard_off_removes_every_hook(spawn, cli):
    p = spawn([TRAIN])
    code = (
        "print(type(optimizer.__dict__.get('step')).__name__, getattr(optimizer.step, '__qualname__', ''), "
        "type(scheduler.__dict__.get('step')).__name__, "
        "[h.__qualname__ for h in model._forward_pre_hooks.values() if 'Guard' in h.__qualname__])"
    )
    before = cli(p.pid, "eval", "--at-step", code).stdout
    assert cli(p.pid, "guard", "--keep", "1", "--skip").returncode == 0
    armed = cli(p.pid, "eval", "--at-step", code).stdout
    off = cli(p.pid, "guard", "--off")
    assert off.returncode == 0 and "hooks left 0" in off.stdout, off.stdout
    after = cli(p.pid, "eval", "--at-step", code).stdout
    assert after == before != armed, (before, armed, after)
    assert "not armed" in cli(p.pid, "guard").stdout
    assert "guard_caught" not in cli(p.pid, "doctor").stdout  # armed, it caught nothing


def test_a_refusal_is_one_sentence_audited_and_nothing_is_armed(spawn, cli, probe_env):
    p = spawn([TRAIN])
    r = cli(p.pid, "guard", "--on", "spike=0.5")
    assert r.returncode != 0 and "give a ratio above 1" in r.stderr and "Traceback" not in r.stderr
    r = cli(p.pid, "guard", "--off", "--skip")
    assert r.returncode != 0 and "--off takes the guard out; give it alone." in r.stderr
    r = cli(p.pid, "guard", "--on", "nonfinite,sometimes")
    assert r.returncode != 0 and "unknown trigger 'sometimes'" in r.stderr
    assert "not armed" in cli(p.pid, "guard").stdout
    with open(os.path.join(probe_env["PROBE_RUNTIME_DIR"], "audit.jsonl")) as f:
        audited = [json.loads(line) for line in f]
    assert [(a["command"], a["outcome"]) for a in audited if a["pid"] == p.pid] == [("guard", "refused")] * 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ddp_ranks_skip_the_same_step(spawn, cli):
    # given: rank 0 alone is fed a poisoned batch; DDP all-reduces its NaN gradients into every rank's
    port = str(_free_port())
    ranks = [
        spawn(
            [TRAIN, "--poison-at", "8", "--steps", "14", "--fault-rank", "0"],
            env={
                "PROBE_GUARD": "nonfinite,skip",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(r),
                "OMP_NUM_THREADS": "1",
            },
            ready=None,
        )
        for r in range(2)
    ]
    finished = [p.wait_for("finished", timeout=120) for p in ranks]
    # then: both skipped the same step, and their replicas are still the same, finite weights
    assert all("finite=True" in line for line in finished)
    assert finished[0].split()[-1] == finished[1].split()[-1]
    caught = [_triggers(cli, p.pid) for p in ranks]
    assert [[c["step"] for c in cs] for cs in caught] == [[caught[0][0]["step"]]] * 2, caught
    assert all(cs[0]["taken"] == "skipped the update" for cs in caught)
    assert all(_digests(p, "pre")[8] == _digests(p, "post")[8] for p in ranks)


@pytest.mark.parametrize("script", ["hf_trainer.py", "lightning_train.py"])
def test_a_framework_job_with_the_guard_armed_trains_as_without_it(spawn, cli, tmp_path, script):
    pytest.importorskip("transformers" if script.startswith("hf") else "lightning")
    args = [TARGETS / script, "--out", tmp_path, "--step-sleep", "0.01"]
    env = {"PROBE": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    plain = spawn(args, env=env, timeout=120)
    guarded = spawn(args, env={**env, "PROBE_GUARD": "nonfinite,spike=50,loss=50,keep=1,skip"}, timeout=120)
    losses = []
    for p in (plain, guarded):
        p.wait_match(r"step 12 loss", timeout=120)
        losses.append([m.group(1) for line in p.lines if (m := re.match(r"^(?:hf |pl )?step \d+ loss (\S+)", line))])
    assert losses[0][:12] == losses[1][:12]
    shown = cli(guarded.pid, "--format", "json", "guard")
    (doc,) = json.loads(shown.stdout)
    assert doc["armed"] == "--on nonfinite,spike=50,loss=50 --keep 1 --skip" and doc["caught"] == [], doc
    assert doc["checked"] >= 10, doc  # its wrapper saw the framework's optimizer steps


def test_the_page_arms_and_takes_out_the_guard_with_allow_actions(spawn, cli, probe_env):
    p = spawn([TRAIN])
    page = start([PROBE_BIN, p.pid, "ui", "--port", "0", "--allow-actions"], probe_env, ready="Ctrl-C stops it")
    try:
        url = next(m.group(0) for line in page.lines if (m := re.search(r"http://127\.0\.0\.1:\d+/\S+/", line)))
        with urllib.request.urlopen(url + "api/config", timeout=10) as resp:
            csrf = json.loads(resp.read())["csrf"]

        def act(params: dict) -> dict:
            body = json.dumps({"name": "guard", "params": params, "confirmed": True}).encode()
            req = urllib.request.Request(url + "api/action", data=body, method="POST", headers={"X-Probe-CSRF": csrf})
            with urllib.request.urlopen(req, timeout=120) as resp:
                return json.loads(resp.read())

        # the page's button sends the triggers with skip, as a flag
        armed = act({"on": "nonfinite,spike=50", "skip": True})
        assert armed["exit_code"] == 0 and "guard armed at step" in armed["output"], armed
        assert "armed --on nonfinite,spike=50 --keep 1 --skip" in cli(p.pid, "guard").stdout
        off = act({"off": True})
        assert off["exit_code"] == 0 and "hooks left 0" in off["output"], off
        audited = cli(p.pid, "query", "SELECT command, state FROM probe.actions WHERE command = 'guard'", "-f", "json")
        assert [r["state"] for r in json.loads(audited.stdout)] == ["done", "done"]
    finally:
        stop_groups([page.popen], grace=5)


def test_skip_is_refused_under_fsdp2_and_the_guard_only_records_there():
    with ddp_job("--steps", "3000", "--step-sleep", "0.01", world=2, target=str(TARGETS / "fsdp2_train.py")) as job:
        r = job.cli("--ranks", "all", "--yes", "guard", "--skip")
        assert r.returncode != 0 and "Traceback" not in r.stderr
        assert r.stderr.count("the parameters are sharded (FSDP2/DTensor)") == 2, r.stderr
        # without --skip/--rollback it records on each rank: no decision that could differ between them
        r = job.cli("--ranks", "all", "--yes", "guard", "--on", "nonfinite,spike=50")
        assert r.returncode == 0, r.stderr
        assert r.stdout.count("guard armed at step") == 2, r.stdout
