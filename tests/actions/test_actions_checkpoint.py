"""`probe checkpoint`: an emergency checkpoint of examples/train_gpt.py resumes exactly."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

from conftest import EXAMPLES, TARGETS, requires_torch, run_target
from harness import other_uid

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


# -- files others could plant or swap ----------------------------------------------------------------------------

ACTIONS = TARGETS / "actions_train.py"
LOAD = (
    "import probe, sys\nfor p in sys.argv[1:]:\n    try:\n        probe.load_checkpoint(p)\n        print('loaded')\n"
    "    except probe.ActionError as e:\n        print(e)\n"
)


def test_names_planted_where_the_checkpoint_is_written_are_never_written_through_nor_adopted(spawn, cli, tmp_path):
    # given a folder like /tmp (sticky, world-writable) where another user planted, at every name a writer could
    # predict (the writer's pid in it, or a fixed suffix), a link to a file of the job's user or a file of their own
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    p = spawn([ACTIONS, "--sched", "none", "--step-sleep", "0.02"])
    for name in (f".a.pt.tmp-{p.pid}", "a.pt.sha256.tmp"):
        (shared / name).symlink_to(victim)
    planted = {}
    for name in (f".b.pt.tmp-{p.pid}", "b.pt.sha256.tmp"):
        (shared / name).write_bytes(b"their weights")
        (shared / name).chmod(0o666)
        if os.geteuid() == 0:
            os.chown(shared / name, other_uid(), other_uid())
        planted[name] = (shared / name).stat().st_ino
    # when the job writes a checkpoint under each name
    for name in ("a.pt", "b.pt"):
        r = cli(p.pid, "--yes", "checkpoint", shared / name)
        assert r.returncode == 0, r.stdout + r.stderr
    # then no link was followed, no planted file became the checkpoint or its checksum, and both are the job's
    assert victim.read_text() == "keep me"
    for name in ("a.pt", "b.pt"):
        for final in (shared / name, shared / f"{name}.sha256"):
            st = final.lstat()
            assert final.is_file() and not final.is_symlink() and st.st_uid == os.geteuid(), final
            assert st.st_ino not in planted.values(), f"{final} is the planted file"
        digest = hashlib.sha256((shared / name).read_bytes()).hexdigest()
        assert (shared / f"{name}.sha256").read_text().split()[0] == digest
    assert all((shared / name).read_bytes() == b"their weights" for name in planted)
    # and the temporary names it used are gone, none of them one that could be predicted
    assert sorted(os.listdir(shared)) == sorted(
        ["a.pt", "a.pt.sha256", "b.pt", "b.pt.sha256", f".a.pt.tmp-{p.pid}", "a.pt.sha256.tmp", *planted]
    )


def test_a_directory_others_could_swap_files_in_and_odd_paths_get_one_sentence(spawn, cli, tmp_path):
    p = spawn([ACTIONS, "--sched", "none", "--step-sleep", "0.02"])
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o775)  # a group-shared project folder, not sticky: a member could replace the file once written
    (tmp_path / "file").write_text("x")
    (tmp_path / "d.pt.sha256").symlink_to(tmp_path / "file")
    cases = [
        (tmp_path / "d.pt", "d.pt.sha256 is a symbolic link"),
        (group / "c.pt", "is writable by other users (mode 775) and not sticky"),
        (f"{tmp_path}/new/", "ends with /, which names a directory"),
        (f"{tmp_path}/a\nb.pt", "control character at position"),
        (tmp_path / "file" / "c.pt", "is not a directory"),
    ]
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, other_uid(), other_uid())
        cases.append((theirs / "c.pt", "belongs to another user"))
    for path, fragment in cases:
        r = cli(p.pid, "--yes", "checkpoint", path)
        assert r.returncode == 5 and fragment in r.stderr, (path, r.stdout + r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Error" not in r.stderr, r.stderr
    assert os.listdir(group) == [] and not (tmp_path / "new").exists()
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["group", "file", "d.pt.sha256"] + (["theirs"] if os.geteuid() == 0 else [])
    )
    assert (tmp_path / "file").read_text() == "x"


def test_load_checkpoint_refuses_files_of_another_user_and_a_directory_in_one_sentence(tmp_path):
    import torch

    # given a checkpoint and its checksum, as probe writes them
    good = tmp_path / "c.pt"
    torch.save({"format": "probe-checkpoint/1", "step": 7}, good)
    (tmp_path / "c.pt.sha256").write_text(f"{hashlib.sha256(good.read_bytes()).hexdigest()}  c.pt\n")
    cases = [(good, "loaded"), (tmp_path, "is a directory"), (tmp_path / "a\nb.pt", "no checkpoint at")]
    if os.geteuid() == 0:  # another user's copies of both, beside ours (a shared folder)
        uid = other_uid()
        for name in ("theirs.pt", "sums.pt"):
            (tmp_path / name).write_bytes(good.read_bytes())
            (tmp_path / f"{name}.sha256").write_text(f"{hashlib.sha256(good.read_bytes()).hexdigest()}  {name}\n")
        os.chown(tmp_path / "theirs.pt", uid, uid)
        os.chown(tmp_path / "sums.pt.sha256", uid, uid)
        cases += [
            (tmp_path / "theirs.pt", f"checkpoint {tmp_path}/theirs.pt belongs to another user (uid {uid})"),
            (tmp_path / "sums.pt", f"checksum file {tmp_path}/sums.pt.sha256 belongs to another user (uid {uid})"),
        ]
    # when load_checkpoint reads each
    r = subprocess.run([sys.executable, "-c", LOAD, *map(str, (c for c, _ in cases))], capture_output=True, text=True)
    # then ours loads, and each other one is refused with one sentence, its path printed escaped
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == len(cases), r.stdout
    for line, (_, fragment) in zip(lines, cases):
        assert fragment in line, (line, fragment)
    assert "a\\nb.pt" in lines[2]
