"""Cost of the guard (``probe guard``) on the training step, measured side by side in one run (CPU).

Blocks of steps rotate through four arms on one model: ``off`` (the guard disarmed: nothing installed), ``keep1``
(armed ``--on nonfinite,spike=50 --keep 1 --skip``: the gradient norm read at each step and the batch copied to the
host), ``rollback`` (the same with ``--rollback``: the weights and optimizer state copied to the host before each
step too) and ``off2`` (disarmed again: the A/A arm, the run's own noise). Two workloads, an MLP sized for ~10 ms
and one for ~100 ms steps. Printed: each arm's median step time and its ratio to ``off``.

    python benchmarks/bench_guard.py [--rounds 6] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import probe  # noqa: E402
from probe.actions import guard  # noqa: E402

ARMS = {
    "off": None,
    "keep1": "nonfinite,spike=50,keep=1,skip",
    "rollback": "nonfinite,spike=50,keep=1,skip,rollback",
    "off2": None,
}


def mlp(width: int):
    model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))
    return model, torch.randn(128, width), torch.randn(128, 1)


def step(model, opt, x, y) -> float:
    t0 = time.perf_counter()
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def sized(target_s: float):
    """A model whose step takes about ``target_s`` on this machine (the width doubled until it does)."""
    width = 128
    while True:
        model, x, y = mlp(width)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # past the first steps: their set-up, and the probe tracing and measuring them
        took = statistics.median([step(model, opt, x, y) for _ in range(10)][5:])
        if took >= target_s / 2 or width >= 16384:
            return model, opt, x, y, width
        width *= 2


def run(target_s: float, rounds: int, steps: int) -> None:
    model, opt, x, y, width = sized(target_s)
    globals().update(model=model, optimizer=opt)  # found by the probe like a script's globals
    for _ in range(5):
        step(model, opt, x, y)  # warm-up, and the probe finds the optimizer
    times = {arm: [] for arm in ARMS}
    for _ in range(rounds):
        for arm, spec in ARMS.items():
            if spec is not None:
                guard.arm(guard.parse_spec(spec), None)
            times[arm] += [step(model, opt, x, y) for _ in range(steps)]
            guard.disarm(None)
    base = statistics.median(times["off"])
    print(
        f"\nsized for ~{target_s * 1000:.0f} ms steps on this machine (MLP width {width}, AdamW), "
        f"{rounds} rounds x {steps} steps per arm:"
    )
    print(f"  {'arm':<10} {'median ms':>10} {'vs off':>8}")
    for arm, ts in times.items():
        med = statistics.median(ts)
        print(f"  {arm:<10} {med * 1000:>10.2f} {med / base:>8.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    probe.start()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    for target in (0.010, 0.100):
        run(target, args.rounds, args.steps)


if __name__ == "__main__":
    main()
