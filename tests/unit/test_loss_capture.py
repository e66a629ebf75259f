"""Every step's loss as the backward wrapper notes it, on CPU, without a process: a CPU scalar is read
once, when its backward is called, and nothing of it is kept (no tensor, no graph) until the boundary; other
scalars are kept detached for the boundary's non-blocking copy. The same loops as real jobs are
tests/training/test_every_step.py and tests/training/test_frameworks.py."""

from __future__ import annotations

import gc
import weakref

import pytest

from conftest import requires_torch

pytestmark = requires_torch


@pytest.fixture
def capture():
    import torch

    from probe.training.capture import Capture

    c = Capture(torch)
    c.wrap()  # torch.autograd.backward and clip_grad_norm_, as the probe wraps them
    try:
        yield c
    finally:
        c.unwrap()


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_a_cpu_loss_is_read_as_a_float_at_its_backward_and_nothing_of_it_is_kept(capture):
    import torch

    model = _model()
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    out = model(x) * 1.0
    loss = torch.nn.functional.mse_loss(out, y)
    value = loss.item()
    kept, saved = weakref.ref(loss), weakref.ref(out)  # the retained graph saves ``out`` for its backward

    loss.backward(retain_graph=True)

    assert capture.losses == [value] and type(capture.losses[0]) is float
    # the step boundary takes it (a measured step's graph check lets go of the graphs there too)
    assert capture.take() == value and capture.losses == []
    capture.take_backwards()
    del loss, out
    gc.collect()
    assert kept() is None and saved() is None  # neither the loss nor its graph outlives the loop's references


def test_accumulated_micro_batches_sum_to_their_mean_and_a_closure_counts_its_first_evaluation(capture):
    import torch

    model = _model()
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
    # given: (loss / 4).backward() over 4 micro-batches
    expected = 0.0
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y) / 4
        expected += loss.item()
        loss.backward()
    assert capture.take() == pytest.approx(expected, abs=1e-6)

    # given: a closure that an optimizer evaluates three times (LBFGS evaluates it again): the first counts
    x, y = batches[0]

    def closure():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    capture.on_step_start(closure)
    first = closure().item()
    closure()
    closure()
    capture.closure_step = False  # the boundary ends the step
    assert capture.take() == pytest.approx(first)


def test_a_tensor_subclass_is_kept_detached_for_the_boundary_never_read_in_the_backward(capture):
    """A DTensor's item() would be a collective: a subclass is detached, and read (its local shard) at the boundary."""
    import torch

    class Sharded(torch.Tensor):
        pass

    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum().as_subclass(Sharded)
    loss.backward()
    (kept,) = capture.losses
    assert isinstance(kept, torch.Tensor) and kept.grad_fn is None and not kept.requires_grad
    assert capture.take() == 6.0
    # a step that noted a CPU float and a kept tensor sums both
    capture.losses[:] = [1.5, torch.tensor(2.0)]
    assert capture.take() == 3.5


def test_the_clip_wrapper_is_in_on_measured_steps_only_and_keeps_their_norm(capture):
    """clip_grad_norm_'s norm is an optional value: its wrapper is not paid on the steps the budget skips."""
    import torch

    original = capture._clip._probe_original
    model = _model()
    torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1)).backward()

    capture.note(False)  # an unmeasured step: torch's own function, nothing kept
    assert torch.nn.utils.clip_grad_norm_ is original
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    assert capture.clip_norm is None

    capture.note(True)  # a measured step: its norm (before clipping) is kept
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    assert torch.nn.utils.clip_grad_norm_ is capture._clip and capture.clip_norm is total

    # another library's wrapper put in since is never taken out
    def theirs(*a, **k):
        return capture._clip(*a, **k)

    torch.nn.utils.clip_grad_norm_ = theirs
    try:
        capture.note(False)
        assert torch.nn.utils.clip_grad_norm_ is theirs
    finally:
        torch.nn.utils.clip_grad_norm_ = capture._clip


def test_the_optimizer_pre_hook_marks_a_step_given_a_closure_and_no_other():
    """torch hands the pre-hook the step's args with the optimizer first: step(), accelerate's step(None), a
    closure by position (LBFGS) and by keyword (Lightning)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from probe.training import hooks

    hooks.arm()
    tk = hooks.tracker()
    seen = []
    after = register_optimizer_step_pre_hook(lambda opt, args, kwargs: seen.append(tk.capture.closure_step))
    try:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def closure():
            loss = torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
            loss.backward()
            return loss

        closure()
        opt.step()
        opt.step(None)
        opt.step(closure)
        opt.step(closure=closure)
        assert seen == [False, False, True, True]
    finally:
        after.remove()
        hooks.disarm()


def test_a_late_device_loss_is_added_once_the_value_it_adds_to_has_landed():
    # given: a step's row whose device loss has not landed, and a loss backpropagated after its boundary (a second
    # optimizer's, in the iteration the lead's step ended) that has
    from probe.util.ring import Pending, landed
    from probe.util.ring import Ring

    class Event:  # torch.cuda.Event's query(), completed when the test says so
        done = False

        def query(self):
            return self.done

    ring = Ring({"loss": "f8"}, 8)
    ring.append(None)
    base, late = Event(), Event()
    pending = Pending(ring, "test")
    pending.keep(0, (("loss", (landed(1.5)[0], base)),))
    pending.keep(0, (("loss", (landed(0.25)[0], late)),), add=True)
    # when / then: the late value waits for the one it adds to, then adds to it
    late.done = True
    pending.resolve()
    assert ring.get("loss", 0) is None and pending.waits(0, "loss")
    base.done = True
    pending.resolve()
    assert ring.get("loss", 0) == 1.75 and not pending.waits(0, "loss")


def test_a_step_the_grad_scaler_skips_lends_its_loss_to_no_other_step():
    """GradScaler skips a step whose gradients are not finite: no optimizer step, so no step boundary. Its loss is
    no step's: the next step's row holds that step's own loss, not the sum of both."""
    import torch

    from probe.training import hooks

    hooks.arm()
    tk = hooks.tracker()
    try:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        poison = [False]
        model[0].weight.register_hook(lambda g: g * float("inf") if poison[0] else g)
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        losses = []
        for bad in (False, True, False):
            poison[0] = bad
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        rows = tk.ring.snapshot()
        assert len(rows["loss"]) == 2  # the skipped step is not a step
        assert [float(v) for v in rows["loss"]] == pytest.approx([losses[0], losses[2]])
    finally:
        hooks.disarm()
