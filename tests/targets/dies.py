"""A small training loop that dies after ``--steps`` steps: by an exception in the loop, in a worker
thread (the loop goes on), a native crash (SIGSEGV), ``sys.exit(3)``, or waits to be killed; or
exits normally.

    python dies.py --how exception|thread|segv|sysexit|wait|exit [--steps N]
"""

import argparse
import ctypes
import os
import sys
import threading
import time

import torch

import probe.auto  # noqa: F401

p = argparse.ArgumentParser()
p.add_argument("--how", default="exception")
p.add_argument("--steps", type=int, default=30)
args = p.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def worker():
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (a planted error in a worker thread)")


for step in range(1, 10**9):
    x = torch.randn(16, 8)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(0.002)  # ok-sleep: keeps the loop gentle on 2 cores
    if step == args.steps:
        print(f"ready pid={os.getpid()} step={step}", flush=True)
        if args.how == "exception":
            raise RuntimeError(f"loss exploded at step {step} (a planted error)")
        if args.how == "thread":
            t = threading.Thread(target=worker, name="data-prefetch")
            t.start()
            t.join()
        if args.how == "segv":
            ctypes.string_at(0)  # a native crash: SIGSEGV
        if args.how == "sysexit":
            sys.exit(3)
        if args.how == "exit":
            break
