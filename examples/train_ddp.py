"""A small DistributedDataParallel job on CPU (gloo) to try ``probe --ranks``.

    PROBE=1 torchrun --nproc-per-node 4 examples/train_ddp.py --steps 0
    probe --ranks all status

Every rank prints ``ready rank=R pid=P`` after its first step. To see what the
fan-out commands find, make one rank slow or stuck:

    --slow-rank 2 --slow-sleep 0.2     rank 2 spends 0.2 s more per step (a straggler)
    --stall-rank 1 --stall-at-step 20  rank 1 stops stepping at step 20 (the others
                                       then wait for it inside the collective)

The same knobs can come from the environment: DDP_SLOW_RANK, DDP_SLOW_SLEEP,
DDP_STALL_RANK, DDP_STALL_AT_STEP. A rank can also be frozen from outside with
``kill -STOP PID``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _env(name, default, cast):
    value = os.environ.get(name)
    return cast(value) if value not in (None, "") else default


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="Steps to run (0 = forever).")
    p.add_argument(
        "--step-sleep", type=float, default=0.02, help="Seconds every rank sleeps per step (simulated data time)."
    )
    p.add_argument("--slow-rank", type=int, default=_env("DDP_SLOW_RANK", None, int), help="Rank that is slower.")
    p.add_argument(
        "--slow-sleep",
        type=float,
        default=_env("DDP_SLOW_SLEEP", 0.2, float),
        help="Extra seconds per step on the slow rank.",
    )
    p.add_argument(
        "--stall-rank", type=int, default=_env("DDP_STALL_RANK", None, int), help="Rank that stops stepping."
    )
    p.add_argument(
        "--stall-at-step", type=int, default=_env("DDP_STALL_AT_STEP", 10, int), help="Step at which it stops."
    )
    return p.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.body(x)


def load_batch(gen, rank, args):
    """Simulated data loading: where a slow or stuck rank spends its time."""
    time.sleep(args.step_sleep)  # ok-sleep: simulated data time
    if rank == args.slow_rank:
        time.sleep(args.slow_sleep)  # ok-sleep: the straggler
    x = torch.randn(16, 32, generator=gen)
    return x, x.sum(dim=1, keepdim=True) * 0.1


def wait_for_data_forever():
    """A stuck input pipeline: this rank never reaches the next collective."""
    while True:
        time.sleep(0.2)  # ok-sleep: the stall being simulated


def train_step(model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)  # the average loss for logging; every rank meets here
    loss.backward()
    optimizer.step()
    return mean_loss.item() / dist.get_world_size()


def say(line: str) -> None:
    """One write per line: ranks share torchrun's stdout, and print() writes the newline separately."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    step = 0
    try:
        while args.steps == 0 or step < args.steps:
            if rank == args.stall_rank and step == args.stall_at_step:
                say(f"stalling rank={rank} step={step}")
                wait_for_data_forever()
            x, y = load_batch(gen, rank, args)
            loss = train_step(model, optimizer, x, y)
            step += 1
            if step == 1:
                say(f"ready rank={rank} pid={os.getpid()} world={world}")
            if rank == 0 and step % 20 == 0:
                say(f"step {step} loss {loss:.4f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
