"""A plain DistributedDataParallel job on CPU (gloo) with no explicit collective in its loop.

Run under torchrun (``PROBE=1 torchrun --nproc-per-node 3 ddp_plain.py``); every rank prints
``ready rank=R pid=P world=W`` after its first step and then trains until killed. The knobs make
one rank the odd one out, from the environment or the command line:

    --stall-rank R --stall-at S   rank R sleeps forever in its data read at step S
    --stall-rank R --stall-when PATH   ... or at its first data read once PATH exists
    --slow-rank R --slow-compute X   rank R computes X seconds more per step
    --slow-rank R --slow-data X   rank R waits X seconds more in its data read per step
    --bad-data-rank R   rank R reads a corrupt shard: targets unrelated to the inputs (its loss stays high)
    --mismatch-rank R --mismatch-at S   rank R issues one extra all_reduce (int32) at step S
    --survive   a rank whose collective fails (a peer died) says so and stays alive, idle
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


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--stall-rank", type=int, default=None)
    p.add_argument("--stall-at", type=int, default=5)
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument("--slow-compute", type=float, default=0.1)
    p.add_argument("--slow-data", type=float, default=0.0)
    p.add_argument("--stall-when", default=None)
    p.add_argument("--bad-data-rank", type=int, default=None)
    p.add_argument("--mismatch-rank", type=int, default=None)
    p.add_argument("--mismatch-at", type=int, default=5)
    p.add_argument("--start-at", type=int, default=0, help="Knobs act only from this step on (0: from the start).")
    p.add_argument("--survive", action="store_true")
    return p.parse_args()


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def read_batch(gen, stall: bool, step_sleep: float, corrupt: bool = False):
    """The data read: where a stalled rank stays."""
    time.sleep(step_sleep)  # ok-sleep: simulated data time
    if stall:
        say(f"stalling rank={os.environ.get('RANK')}")
    while stall:
        time.sleep(0.2)  # ok-sleep: the stalled input pipeline being simulated
    x = torch.randn(16, 32, generator=gen)
    if corrupt:  # a corrupt shard: targets that have nothing to do with the inputs
        return x, torch.randn(16, 1, generator=gen) * 3
    return x, x.sum(dim=1, keepdim=True) * 0.1


def extra_compute(seconds: float) -> None:
    """More work on this rank only: matrix products for ``seconds`` of wall time."""
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    step = 0
    try:
        while True:
            stall = rank == args.stall_rank and (
                os.path.exists(args.stall_when) if args.stall_when else step == args.stall_at + args.start_at
            )
            slow = rank == args.slow_rank and step >= args.start_at
            x, y = read_batch(
                gen, stall, args.step_sleep + (args.slow_data if slow else 0.0), corrupt=rank == args.bad_data_rank
            )
            if slow and not args.slow_data:
                extra_compute(args.slow_compute)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            if rank == args.mismatch_rank and step == args.mismatch_at + args.start_at:
                say(f"mismatch rank={rank} step={step}")
                # a collective the other ranks never issue; as many bytes as their gradient bucket, so gloo
                # does not abort on a size check: a silent mismatch that shifts every later collective
                dist.all_reduce(torch.ones(sum(p.numel() for p in model.parameters()), dtype=torch.int32))
            loss.backward()
            optimizer.step()
            step += 1
            if step == 1:
                say(f"ready rank={rank} pid={os.getpid()} world={world}")
    except (RuntimeError, dist.DistBackendError) as exc:
        if not args.survive:
            raise
        say(f"collective failed rank={rank}: {str(exc).splitlines()[0][:200]}")
        while True:
            time.sleep(1)  # ok-sleep: stays alive to be inspected


if __name__ == "__main__":
    main()
