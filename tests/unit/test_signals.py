"""What a measured step's batch, update and loss scaling were (probe/training/signals.py), on CPU without a
process: the fingerprints and label counts of a batch, the update/weight ratio of one optimizer step between the
probe's step pre-hook calls, and a clip's norm unscaled when GradScaler had not unscaled the gradients yet."""

from __future__ import annotations

import pytest

from conftest import requires_torch

pytestmark = requires_torch


@pytest.fixture
def setup():
    import torch

    from probe.training import finder
    from probe.training.signals import Signals

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    finder.add(model, "model", "test", "model")
    sig = Signals(torch)
    yield torch, model, opt, sig
    sig.close()  # an update still armed would reach the step pre-hook of other tests' optimizers


def _loss(torch, model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def test_a_batch_fed_again_has_the_same_fingerprint_and_its_labels_are_counted(setup):
    torch, model, opt, sig = setup
    x, y = torch.randn(32, 6), torch.tensor([2] * 24 + [0] * 8)
    for step, (xs, ys) in enumerate([(x, y), (x.clone(), y.clone()), (torch.randn(32, 6), y)], start=1):
        sig.on_input(xs)
        sig.on_loss(_loss(torch, model, xs, ys))
        sig.at_boundary(step, opt)
    rows = sig.snapshot("batches")
    assert rows["input_hash"][0] == rows["input_hash"][1] != rows["input_hash"][2]
    assert len(set(rows["target_hash"])) == 1
    assert (rows["labels"][0], rows["top_label"][0], rows["top_share"][0], rows["samples"][0]) == (2, 2, 0.75, 32)


def test_the_update_of_the_step_after_a_measured_one_is_its_size_against_the_weights(setup):
    torch, model, opt, sig = setup
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    sig.at_boundary(1, opt)  # a measured step: the next step's update is measured
    weights = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    opt.zero_grad()
    _loss(torch, model, x, y).backward()
    sig.before_step(opt)  # the probe's step pre-hook, in step 2's optimizer.step()
    opt.step()
    sig.before_step(opt)  # and before step 3: after step 2
    rows = sig.snapshot("updates")
    assert list(rows["step"]) == [2, 2] and list(rows["parameter"]) == ["0.weight", "2.weight"]
    for w, ratio, pulled, p in zip(weights, rows["ratio"], rows["grad_ratio"], (model[0].weight, model[2].weight)):
        assert ratio == pytest.approx(float((p.detach() - w).norm() / w.norm()), rel=1e-5)
        assert pulled == pytest.approx(float(p.grad.norm() / w.norm()), rel=1e-5)  # SGD: the update is lr x this
        assert ratio == pytest.approx(0.1 * pulled, rel=1e-4)
    assert list(rows["lr"]) == [0.1, 0.1]
    # disarmed after it: further steps cost the step boundary nothing and add no rows
    from probe.training import boundary

    assert sig.before_step not in boundary.before


def test_the_update_is_measured_with_the_weights_size_and_its_time_kept_for_the_step(setup):
    # the measurement runs in the optimizer's pre-hook, outside the boundary the tracker times: its time is kept
    # for the tracker to add to a boundary's probe_us (what the step budget is charged)
    torch, model, opt, sig = setup
    sig.spent_ns = 0
    sig.at_boundary(1, opt)
    before = model[0].weight.detach().clone()
    opt.zero_grad()
    _loss(torch, model, torch.randn(32, 6), torch.randint(0, 3, (32,))).backward()
    sig.before_step(opt)
    opt.step()
    sig.before_step(opt)
    assert sig.spent_ns > 0
    rows = sig.snapshot("updates")
    assert rows["norm"][0] == pytest.approx(float(before.norm()), rel=1e-5)


def test_a_clip_before_unscale_is_seen_and_its_norm_unscaled(setup):
    torch, model, opt, sig = setup
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    sig.at_boundary(1, opt)  # the lead optimizer is known
    for unscale_first, step in ((False, 2), (True, 3)):
        opt.zero_grad()
        scaler.scale(_loss(torch, model, x, y)).backward()
        sig.on_scale(scaler)
        if unscale_first:
            scaler.unscale_(opt)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        seen = sig.on_clip(total)
        assert float(seen) == pytest.approx(float(total) if unscale_first else float(total) / 65536.0)
        scaler.step(opt)
        sig.at_boundary(step, opt)
        scaler.update()
    rows = sig.snapshot("scaler")
    assert list(rows["clip_scaled"]) == [True, False] and list(rows["scale"]) == [65536.0, 65536.0]
