"""The step boundary's quick path, side by side for several checkouts: its own timing (probe_us) per step.

Most steps of a fast loop take the quick path of ``StepTracker.on_optimizer_step`` (not measured,
not traced, nothing queued), so a refactoring of ``probe/training/steps.py`` must not slow it.
For each checkout given (a folder holding ``probe/``; default: this one), in turn and ``--rounds``
times over so that a busy host's drift hits them alike, one fresh process trains a tiny MLP
with Adam on the CPU for ``--steps`` steps and prints the 10th percentile, median and 90th
percentile of ``torch.steps.probe_us`` over its unmeasured steps (the first 500 left out). The
10th percentile is the figure to compare on a shared machine: waits for a core only add.

    python benchmarks/bench_quick_path.py [--rounds 3] [--steps 6000] [CHECKOUT ...]

To compare with an older commit: ``git archive COMMIT | tar -x -C /tmp/base`` and pass
``/tmp/base .``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np, torch, torch.nn as nn
from probe.training import hooks
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 64), torch.randn(32, 1)
hooks.arm()
for _ in range(int(sys.argv[2])):
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
cols = hooks.tracker().ring.snapshot()
us = cols["probe_us"][500:][~cols["measured"][500:].astype(bool)]
print(f"{len(us)} {np.percentile(us, 10):.2f} {np.median(us):.2f} {np.percentile(us, 90):.2f}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkouts", nargs="*", default=[os.path.dirname(os.path.dirname(os.path.abspath(__file__)))])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6000)
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE")}
    print("quick-path probe_us per unmeasured step (us): p10, median, p90")
    for r in range(a.rounds):
        for root in a.checkouts:
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, os.path.abspath(root), str(a.steps)],
                capture_output=True,
                text=True,
                env=env,
                cwd="/",
            )
            if out.returncode != 0:
                sys.exit(f"{root}: the training process failed:\n{out.stderr}")
            n, p10, med, p90 = out.stdout.split()
            print(f"  round {r + 1}  {root}: {n} steps  p10 {p10}  median {med}  p90 {p90}")


if __name__ == "__main__":
    main()
