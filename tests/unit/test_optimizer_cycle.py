"""The optimizer cycle: which optimizer's step ends an iteration of a loop that steps several (a GAN's
discriminator and generator, a WGAN's critic steps), from the order the steps come in. The same loops as real
jobs are tests/training/test_torch_gan.py."""

from __future__ import annotations

from conftest import requires_torch

pytestmark = requires_torch


class _Opt:
    """A stand-in optimizer: the cycle only keeps identities."""


def _closes(seq, opts) -> list:
    from probe.training.steprows import OptimizerCycle

    cycle = OptimizerCycle(opts[seq[0]], True)  # the lead's first step is where the tracker starts the cycle
    return [cycle.see(opts[k]) for k in seq[1:]]


def test_the_iteration_is_recognised_from_the_order_of_optimizer_steps():
    d, g, e = _Opt(), _Opt(), _Opt()
    opts = {"D": d, "G": g, "E": e}
    # a GAN: D G, recognised at the second G, then every G ends an iteration
    assert _closes("DGDGDGDG", opts) == [None, None, True, False, True, False, True]
    # a WGAN's five critic steps per generator step
    got = _closes("DDDDDG" * 3, opts)
    assert got[10] is True and got[11:] == [False] * 5 + [True]
    # three optimizers
    assert _closes("DGEDGEDGE", opts)[-4:] == [True, False, False, True]
    # a step out of turn drops the cycle: the lead's steps end steps again (None) until a cycle is seen again
    assert _closes("DGDGDGDD", opts)[-2:] == [False, None]
    assert _closes("DGDGDDDD", opts)[-1] is None
    # probe.watch named G before anything stepped: the iteration still starts with the first optimizer to step
    from probe.training.steprows import OptimizerCycle

    cycle = OptimizerCycle(d, False)
    assert [cycle.see(opts[k]) for k in "DGDGDG"] == [None, None, None, True, False, True]
