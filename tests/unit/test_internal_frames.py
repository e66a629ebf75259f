"""Which frames are the training loop's: the first one outside torch, probe and the training frameworks
(probe.util.usercode.is_user_code), by normalised path."""

from __future__ import annotations

from conftest import requires_torch


@requires_torch
def test_torch_and_probe_frames_are_told_apart_by_normalised_path():
    """The training loop's frame is the first one outside torch, probe and the training frameworks; a
    module imported through a path like ``bench/../probe`` must still count as probe, and torchvision as not torch."""
    import os

    import torch

    from probe.util.usercode import is_user_code

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    probe_dir = os.path.dirname(os.path.dirname(os.path.abspath(is_user_code.__code__.co_filename)))  # probe/
    other = os.path.join(os.path.dirname(probe_dir), "benchmarks")

    def internal(path):
        return not is_user_code(compile("pass", path, "exec"))

    assert internal(os.path.join(other, "..", "probe", "training", "hooks.py"))
    assert internal(os.path.join(torch_dir, "optim", "optimizer.py"))
    assert internal("<frozen importlib._bootstrap>")
    assert not internal(torch_dir + "vision" + os.sep + "models.py")
    assert not internal(probe_dir + "_utils" + os.sep + "train.py")
    assert not internal(os.path.join(other, "bench_torch.py"))
    assert not internal("<stdin>")
