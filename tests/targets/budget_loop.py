"""A seeded loop for the step-budget tests (PROBE_STEP_BUDGET decides which steps are measured).

Runs ``--steps N`` steps (``--step-sleep`` apart, else as fast as it can), prints ``losses``
(each step's loss, as the loop computed it) and ``ready``, then goes on stepping every
``--then-sleep`` seconds so actions have steps to land on. Plain SGD, no scheduler: the lr
changes only when ``probe lr`` changes it.
"""

import argparse
import os
import time

import torch

import probe.auto  # noqa: F401

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--then-sleep", type=float, default=0.005)
args = p.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)


def train_step():
    batch = torch.randn(16, 8)
    loss = (model(batch) - batch.sum(1, keepdim=True)).pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


losses = []
for _ in range(args.steps):
    losses.append(train_step())
    if args.step_sleep:
        time.sleep(args.step_sleep)  # ok-sleep: the target's slow steps
print("losses " + " ".join(repr(v) for v in losses), flush=True)
print(f"ready pid={os.getpid()}", flush=True)
while True:
    train_step()
    time.sleep(args.then_sleep)  # ok-sleep: pacing of the steps after the measured run
