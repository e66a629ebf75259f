"""A training loop inside a function (the usual case), for the locals-retention test.

Prints how often the previous step's logits were still alive after the loop rebound
the name (``alive``) and, for a loop whose step is a function of its own, once that
function had returned (``alive_fn``: the probe must not keep a finished step's frame),
plus checksums of the loop's own variables. STEP_FN=1 runs the second loop. TRACE=1 runs it under a trace
function (as a debugger would); NO_PROBE=1 runs it without probe.
"""

import os
import sys
import weakref

import torch

if os.environ.get("NO_PROBE") != "1":
    import probe.auto  # noqa: F401


def train():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    old, alive, total, checksum = None, 0, 0.0, 0
    for step in range(20):
        x = torch.randn(4, 8, generator=g)
        logits = model(x)
        if old is not None and old() is not None:
            alive += 1
        loss = logits.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
        checksum += step
        old = weakref.ref(logits)
    print(f"alive={alive} total={total:.6f} checksum={checksum}", flush=True)


def train_by_step_function():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []

    def step(x):
        logits = model(x)
        kept.append(weakref.ref(logits))
        loss = logits.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    alive = 0
    for _ in range(20):
        step(torch.randn(4, 8))
        alive += kept[-1]() is not None  # the step returned: its logits must be gone
    print(f"alive_fn={alive}", flush=True)


if os.environ.get("TRACE") == "1":

    def tracer(frame, event, arg):
        return tracer

    sys.settrace(tracer)
if os.environ.get("STEP_FN") == "1":
    train_by_step_function()
else:
    train()
