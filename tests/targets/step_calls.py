"""Counts the Python calls the probe adds to an unmeasured step of a loop written as others write them.

Three Linear layers with in-place ReLUs, Adam, StepLR, cross-entropy, globals at module level. After
``--warmup`` steps it runs ``--steps`` steps with the probe's hooks running, as many paused, and as many after
they resume, counting every call on the training thread in each step (``sys.setprofile``: Python functions and
the builtins they call), and prints one JSON line: the median count per step of each arm, and of the steps after
the resume, how many the probe measured and how many kept a loss and a data wait, and whether the model copies.
"""

import argparse
import copy
import json
import pickle
import statistics
import sys

import numpy as np
import torch
import torch.nn as nn

import probe.auto  # noqa: F401
from probe.training import hooks

p = argparse.ArgumentParser()
p.add_argument("--warmup", type=int, default=300)
p.add_argument("--steps", type=int, default=300)
args = p.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(
    nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, 10)
)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000, gamma=0.5)
criterion = nn.CrossEntropyLoss()
x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
calls = [0]


def count(frame, event, arg):
    if event == "call" or event == "c_call":
        calls[0] += 1


def train_step():
    optimizer.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
    scheduler.step()


def counted(n: int) -> list:
    per_step = []
    for _ in range(n):
        calls[0] = 0
        sys.setprofile(count)
        train_step()
        sys.setprofile(None)
        per_step.append(calls[0])
    return per_step


for _ in range(args.warmup):
    train_step()
on = counted(args.steps)  # the steady state: the start-up's measured steps are behind
hooks.pause()
off = counted(args.steps)
hooks.resume()
train_step()  # the resume's own boundary
tracker = hooks.tracker()
first = tracker.step + 1
resumed = counted(args.steps)
snap = tracker.ring.snapshot()
new = np.asarray(snap["step"]) >= first


def kept(column: str) -> int:  # the new rows with a value (not NULL, not NaN)
    values = np.ma.asarray(snap[column])
    return int((~np.ma.getmaskarray(values) & ~np.isnan(np.ma.getdata(values)))[new].sum())


print(
    json.dumps(
        {
            "off": statistics.median(off),
            "on": statistics.median(on),
            "resumed": statistics.median(resumed),
            "steps": int(new.sum()),
            "measured": int(np.asarray(snap["measured"])[new].sum()),
            "with_loss": kept("loss"),
            "with_data_wait": kept("data_wait"),
            "copies": len(pickle.dumps(copy.deepcopy(model))) > 0,  # the clock on the model is not copied
        }
    ),
    flush=True,
)
