"""`probe checkpoint`: an emergency checkpoint of examples/train_gpt.py resumes exactly."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

from conftest import EXAMPLES, requires_torch, run_target

pytestmark = requires_torch
GPT = EXAMPLES / "train_gpt.py"
SMALL = ["--layers", "1", "--batch", "8", "--print-every", "1"]


def losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+) loss (\S+)", text, re.M)}


def test_emergency_checkpoint_resumes_with_the_same_losses(spawn, cli, probe_env, tmp_path):
    # given a run that gets an emergency checkpoint mid-way and dies
    p = spawn([GPT, "--steps", "0", "--step-sleep", "0.05", *SMALL])
    p.wait_for("step 5 ")
    path = tmp_path / "ckpt" / "emergency-{rank}.pt"
    r = cli(p.pid, "checkpoint", path)
    assert r.returncode == 0, r.stderr
    step = int(re.search(r"at step (\d+)", r.stdout).group(1))
    written = tmp_path / "ckpt" / "emergency-0.pt"
    assert step >= 5 and written.exists()
    assert sorted(os.listdir(written.parent)) == ["emergency-0.pt", "emergency-0.pt.sha256"]  # no temp file left
    with open(str(written) + ".sha256") as f:
        assert f.read().split()[0] == hashlib.sha256(written.read_bytes()).hexdigest()
    p.popen.kill()
    # when an identical run goes a few steps past that step uninterrupted (its length follows the checkpoint's step,
    # which depends on how fast this machine answered), and a run resumes from the checkpoint to the same end
    steps = str(step + 4)
    ref = run_target([GPT, "--steps", steps, *SMALL], probe_env)
    assert ref.returncode == 0, ref.stderr
    ref_losses = losses(ref.stdout)
    ref_done = re.search(r"^done .*$", ref.stdout, re.M).group(0)
    res = run_target([GPT, "--steps", steps, "--resume", written, *SMALL], probe_env)
    # then resuming reproduces the next step's loss and the end of the run exactly
    assert res.returncode == 0, res.stderr
    assert f"resumed from {written} at step {step}" in res.stdout
    got = losses(res.stdout)
    assert got[step + 1] == ref_losses[step + 1]
    assert all(got[s] == ref_losses[s] for s in got)
    assert re.search(r"^done .*$", res.stdout, re.M).group(0) == ref_done


def test_checkpoint_contents_force_and_plain_torch_load(spawn, cli, tmp_path):
    import torch

    p = spawn([GPT, "--steps", "0", "--step-sleep", "0.02", *SMALL])
    r = cli(p.pid, "eval", "print(train_loader.num_workers, trainer.grad_clip, type(scheduler).__name__)")
    assert r.stdout.strip() == "0 1.0 LambdaLR", r.stderr
    target = tmp_path / "c.pt"
    assert cli(p.pid, "checkpoint", target).returncode == 0
    state = torch.load(target)  # plain torch.load, weights_only by default
    assert {"model", "optimizer", "scheduler", "step", "rng"} <= set(state)
    assert {"python", "torch", "numpy"} <= set(state["rng"])
    assert state["probe"]["pid"] == p.pid and state["probe"]["at_safe_point"] is True
    first = target.read_bytes()
    r = cli(p.pid, "checkpoint", target)
    assert r.returncode == 5 and "--force" in r.stderr and target.read_bytes() == first
    r = cli(p.pid, "checkpoint", target, "--force")
    assert r.returncode == 0 and torch.load(target)["step"] > state["step"]
    # a damaged file is refused by load_checkpoint
    target.write_bytes(target.read_bytes()[:-10] + b"0123456789")
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "import probe, sys\ntry:\n    probe.load_checkpoint(sys.argv[1])\n"
            "except probe.ActionError as e:\n    print(e)",
            str(target),
        ],
        capture_output=True,
        text=True,
    )
    assert "does not match its checksum" in check.stdout
