"""A few training steps, then the main thread waits in C with the GIL released and never comes
back to Python (as a gloo rank waits in ``all_reduce`` for a peer that never comes). It never
imports probe: run it with PROBE=1 to probe it.

    python blocked_in_c.py [--steps N]
"""

import argparse
import os
import sys

import torch

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
args = p.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _step in range(1, args.steps + 1):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"ready pid={os.getpid()} probe_loaded={'probe' in sys.modules}", flush=True)
torch.futures.Future().wait()  # a condition variable in C++: signals do not interrupt it
