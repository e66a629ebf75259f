"""probe.util.files: how a file is written where other users can plant names, and read back."""

from __future__ import annotations

import os
import re

import pytest

from harness import other_uid

from probe import ProbeError
from probe.util import files

DEAD_PID = 4194305  # above the largest pid_max Linux allows: no process has it


@pytest.fixture
def shared(tmp_path):
    """A folder like /tmp: world-writable and sticky."""
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(0o1777)
    return path


def test_every_write_goes_through_a_new_file_under_a_name_no_one_can_predict(shared):
    seen = []

    def fill(f):
        seen.append(sorted(set(os.listdir(shared)) - {"out.json"}))
        f.write(b"{}")

    files.write_file(str(shared / "out.json"), fill)
    files.write_file(str(shared / "out.json"), fill)
    assert [len(names) for names in seen] == [1, 1] and seen[0] != seen[1]
    for (name,) in seen:
        assert re.fullmatch(rf"\.out\.json\.[0-9a-f]{{16}}\.{os.getpid()}\.tmp", name), name
    assert os.listdir(shared) == ["out.json"] and (shared / "out.json").read_bytes() == b"{}"


def test_a_link_at_the_output_is_never_written_through_and_a_kept_file_never_replaced(shared, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (shared / "link.json").symlink_to(victim)
    with pytest.raises(ProbeError, match="is a symbolic link"):
        files.write_file(str(shared / "link.json"), lambda f: f.write(b"x"))
    (shared / "old.json").write_text("old")
    with pytest.raises(FileExistsError):
        files.write_file(str(shared / "old.json"), lambda f: f.write(b"x"), replace=False)
    with pytest.raises(ProbeError, match="ends with /"):
        files.write_file(f"{shared}/new/", lambda f: f.write(b"x"))
    assert victim.read_text() == "keep me" and (shared / "old.json").read_text() == "old"
    assert sorted(os.listdir(shared)) == ["link.json", "old.json"]


def test_a_directory_other_users_could_swap_files_in_is_refused(tmp_path):
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o775)
    with pytest.raises(ProbeError, match=r"writable by other users \(mode 775\) and not sticky"):
        files.write_file(str(group / "out.json"), lambda f: f.write(b"x"))
    with pytest.raises(ProbeError, match="not sticky"):
        files.check_target(str(group / "out.json"), replace=True)
    assert os.listdir(group) == []
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, other_uid(), other_uid())
        with pytest.raises(ProbeError, match="belongs to another user"):
            files.write_file(str(theirs / "out.json"), lambda f: f.write(b"x"))


def test_the_sweep_removes_only_this_users_temporaries_of_writers_that_died(shared, tmp_path):
    ours = shared / f".c.pt.0123456789abcdef.{DEAD_PID}.tmp"
    kept = [
        shared / f".c.pt.0123456789abcdef.{os.getpid()}.tmp",  # a live writer's
        shared / f".c.pt.tmp-{DEAD_PID}",  # a name the writer never uses
        shared / f".c.pt.0123456789ABCDEF.{DEAD_PID}.tmp",
        shared / f".d.pt.0123456789abcdef.{DEAD_PID}.tmp",  # another file's
    ]
    for path in [ours, *kept]:
        path.write_bytes(b"half")
    kept.append(shared / f".c.pt.aaaaaaaaaaaaaaaa.{DEAD_PID}.tmp")
    kept[-1].symlink_to(tmp_path)
    if os.geteuid() == 0:
        kept.append(shared / f".c.pt.bbbbbbbbbbbbbbbb.{DEAD_PID}.tmp")
        kept[-1].write_bytes(b"theirs")
        os.chown(kept[-1], other_uid(), other_uid())
    assert files.sweep_temps(str(shared / "c.pt")) == 1
    assert not ours.exists() and all(os.path.lexists(p) for p in kept)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_file_of_another_user_is_neither_replaced_nor_read_back(tmp_path):
    path = tmp_path / "c.pt"
    path.write_bytes(b"weights")
    with files.open_own(str(path)) as f:
        assert f.read() == b"weights"
    os.chown(path, other_uid(), other_uid())
    with pytest.raises(ProbeError, match=r"belongs to another user \(uid \d+\)"):
        files.open_own(str(path))
    with pytest.raises(ProbeError, match=r"belongs to another user \(uid \d+\); probe does not replace it"):
        files.write_file(str(path), lambda f: f.write(b"ours"))
    assert path.read_bytes() == b"weights" and os.listdir(tmp_path) == ["c.pt"]
