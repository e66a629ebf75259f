"""A small seeded training loop for the guarded-action tests.

``--optim`` (SGD, Adam) and ``--dtype`` pick the optimizer and the parameters' dtype; ``--sched NAME`` picks
the LR scheduler (none, StepLR, CosineAnnealingLR, LambdaLR, LinearLR, OneCycleLR, ReduceLROnPlateau,
SequentialLR); ``--step-sleep`` slows steps down;
``--hang-after N`` makes the main thread sleep forever in time.sleep after N steps;
``--stall-file F`` pauses between steps while F exists (prints ``stalled`` once per pause); with ``--stall-for S``
the pause is one sleep of S seconds instead (the main thread sleeps throughout, as a stalled job's does).
Steps end at the probe's step boundary: torch's optimizer-step hook when this probe has it,
else an explicit boundary.passed. Prints ``ready`` after the first step, then ``step N lr X``.
"""

import argparse
import os
import sys
import time

import torch

import probe.auto  # noqa: F401
import probe
from probe.training import boundary as step_boundary


def make_scheduler(name, optimizer):
    s = torch.optim.lr_scheduler
    if name == "none":
        return None
    if name == "StepLR":
        return s.StepLR(optimizer, step_size=3, gamma=0.5)
    if name == "CosineAnnealingLR":
        return s.CosineAnnealingLR(optimizer, T_max=50, eta_min=0.0)
    if name == "LambdaLR":
        return s.LambdaLR(optimizer, lambda e: 1.0 / (1 + e))
    if name == "LinearLR":
        return s.LinearLR(optimizer, start_factor=0.2, total_iters=40)
    if name == "OneCycleLR":
        return s.OneCycleLR(optimizer, max_lr=0.1, total_steps=100000)
    if name == "ReduceLROnPlateau":
        return s.ReduceLROnPlateau(optimizer, patience=1000)
    if name == "SequentialLR":
        return s.SequentialLR(
            optimizer,
            [s.ConstantLR(optimizer, factor=0.5, total_iters=2), s.ExponentialLR(optimizer, gamma=0.9)],
            milestones=[2],
        )
    raise SystemExit(f"unknown scheduler {name}")


def boundary(i):
    """Only needed while this probe has no automatic optimizer-step hook."""
    if not hasattr(probe, "step"):
        step_boundary.passed(i, sys._getframe(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sched", default="StepLR")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--hang-after", type=int, default=0)
    p.add_argument("--stall-file")
    p.add_argument("--stall-for", type=float, default=0.0)
    p.add_argument("--optim", default="SGD", choices=["SGD", "Adam"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()
    global model, optimizer, scheduler, trainer_state
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(dtype)
    if args.optim == "Adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = make_scheduler(args.sched, optimizer)
    trainer_state = {"step": 0}
    step = 0
    while True:
        batch = torch.randn(4, 8, dtype=dtype)
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        trainer_state["step"] = step
        boundary(step)
        if scheduler is not None:
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                scheduler.step(1.0 / step)
            else:
                scheduler.step()
        if step == 1:
            print(f"ready pid={os.getpid()}", flush=True)
        print(f"step {step} lr {optimizer.param_groups[0]['lr']:.8g}", flush=True)
        if args.hang_after and step >= args.hang_after:
            print("hanging", flush=True)
            time.sleep(3600)  # ok-sleep: the stuck training thread the --now test needs
        if args.stall_file and os.path.exists(args.stall_file):
            print(f"stalled at step {step}", flush=True)
            if args.stall_for:
                os.unlink(args.stall_file)
                time.sleep(args.stall_for)  # ok-sleep: a stalled training thread, bounded
            while os.path.exists(args.stall_file):
                time.sleep(0.02)  # ok-sleep: a stalled training thread, released by the test
            print(f"resumed at step {step}", flush=True)
        time.sleep(args.step_sleep)  # ok-sleep: pacing of the target's steps


if __name__ == "__main__":
    main()
