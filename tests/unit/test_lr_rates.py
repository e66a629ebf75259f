"""The arithmetic of learning rates that the lr action applies: ratios that never divide by a denormal or
zero, scheduler numbers scaled only by a factor that can be divided out again, and the smallest rate each
parameter dtype's update can take. The action on real jobs is tests/actions/test_actions_lr.py."""

from __future__ import annotations

import math
import sys

import pytest

from conftest import requires_torch

pytestmark = requires_torch


def _steplr(lr: float = 0.05):
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _numbers(opt, sched) -> list:
    g = opt.param_groups[0]
    return [g["lr"], g["initial_lr"], sched.base_lrs[0], sched._last_lr[0]]


def test_ratios_refuse_a_denormal_or_zero_divisor_and_an_unusable_quotient():
    from probe.actions.lroverride import invertible, ratio

    assert ratio(0.05, 0.025) == 2.0 and ratio(0.0, 3.0) == 0.0
    for a, b in [(0.05, 5e-324), (0.05, 0.0), (0.05, math.nan), (1.0, math.inf), (1e300, 1e-300), (1e-300, 1e100)]:
        assert ratio(a, b) is None, (a, b)
    assert invertible(sys.float_info.min * 4) and not invertible(5e-324 / 0.05) and not invertible(0.0)


def test_a_factor_that_cannot_be_divided_out_again_changes_nothing():
    from probe.actions.lroverride import rescale

    opt, sched = _steplr()
    before = _numbers(opt, sched)
    # 5e-324 / 0.05: a denormal factor whose inverse is infinite; 0: no inverse at all
    for factor in (5e-324 / 0.05, 0.0, math.nan, math.inf):
        assert rescale(sched, opt.param_groups[0], 0, factor) is False, factor
        assert _numbers(opt, sched) == before, factor
    # a factor that would leave a scheduler number past what the dtype takes likewise
    assert rescale(sched, opt.param_groups[0], 0, 1e10, limit=1e6) is False and _numbers(opt, sched) == before


def test_a_tiny_rate_then_reset_gives_the_unchanged_schedule_back_finite():
    from probe.actions.lroverride import ratio, rescale

    opt, sched = _steplr()
    ref_opt, ref_sched = _steplr()
    for _ in range(3):
        opt.step(), sched.step(), ref_opt.step(), ref_sched.step()
    factor = ratio(1.2e-38, opt.param_groups[0]["lr"])  # the smallest rate float32 takes, set through the scheduler
    assert rescale(sched, opt.param_groups[0], 0, factor)
    assert opt.param_groups[0]["lr"] == pytest.approx(1.2e-38, rel=1e-12)
    for _ in range(5):  # StepLR multiplies the group's current rate on
        opt.step(), sched.step(), ref_opt.step(), ref_sched.step()
    assert rescale(sched, opt.param_groups[0], 0, factor, undo=True)
    for got, want in zip(_numbers(opt, sched), _numbers(ref_opt, ref_sched)):
        assert math.isfinite(got) and got == pytest.approx(want, rel=1e-12), (got, want)


@pytest.mark.parametrize(
    ("dtype", "computed"),
    [("float32", "float32"), ("float16", "float32"), ("bfloat16", "float32"), ("float64", "float64")],
)
def test_the_smallest_rate_is_the_smallest_normal_of_the_dtype_the_update_is_computed_in(dtype, computed):
    import torch

    from probe.actions.lr import dtype_floor

    group = {"params": [torch.nn.Parameter(torch.zeros(2, dtype=getattr(torch, dtype)))], "lr": 0.1}
    assert dtype_floor(group) == (torch.finfo(getattr(torch, computed)).tiny, computed, dtype)
    # 5e-324 passes "> 0" and is 0 in float32: below every floor but float64's denormals
    assert float(torch.tensor(5e-324, dtype=torch.float32)) == 0.0 and 5e-324 < dtype_floor(group)[0]
