"""A tiny FSDP2 (``torch.distributed.fsdp.fully_shard``) job on CPU (gloo), or one GPU per rank (``--backend nccl``).

Run under torchrun with PROBE=1 and no probe code:
``PROBE=1 python -m torch.distributed.run --nproc-per-node 2 fsdp2_train.py --steps 2000``.
Each rank prints ``ready rank=R pid=P world=W`` after its first step, ``progress rank=R step=S``
every 500 steps and ``done rank=R steps=S`` at the end, then waits (``--linger``) so the test can
still read its tables, or exits. With ``--until FILE`` the job trains on past ``--steps`` until FILE exists: the
ranks agree on it every 50 steps (an all_reduce of the job's own), so all stop at the same step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=2000)
p.add_argument(
    "--step-sleep", type=float, default=0.0, help="Seconds to sleep each step: a floor under the job's length."
)
p.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (CUDA, one GPU per rank).")
p.add_argument("--until", default=None, help="After --steps, train on until this file exists.")
p.add_argument("--linger", action="store_true", help="After the last step, wait (in Python) until killed.")
p.add_argument(
    "--resume", default=None, help="Load probe.load_checkpoint(PATH) first, {rank} expanded; print what it held."
)
args = p.parse_args()

dev = torch.device("cpu")
if args.backend == "nccl":
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
dist.init_process_group(args.backend)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
fully_shard(model)  # one unit: one all_gather and one reduce-scatter a step keep 2000 steps quick on gloo
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator(dev).manual_seed(rank)
if args.resume:
    import probe

    state = probe.load_checkpoint(args.resume.replace("{rank}", str(rank)), model=model, optimizer=optimizer)
    w = model[0].weight
    print(
        f"resumed rank={rank} step={state['step']} sharded={state.get('sharded')} "
        f"local={tuple(w.to_local().shape)} of={tuple(w.shape)} "
        f"match={bool(torch.equal(w.to_local(), state['model']['0.weight'].to_local()))}",
        flush=True,
    )


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


step = 0
while True:
    if step >= args.steps:
        if args.until is None:
            break
        if step % 50 == 0:  # every rank stops at the same step: they agree on the file at the same steps
            seen = torch.tensor([float(os.path.exists(args.until))], device=dev)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
            if seen.item():
                break
    step += 1
    x = torch.randn(8, 16, generator=gen, device=dev)
    y = torch.randint(0, 4, (8,), generator=gen, device=dev)
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if args.step_sleep:
        time.sleep(args.step_sleep)  # ok-sleep: a floor under the step time, so the job outlasts a round of queries
    if step == 1:
        say(f"ready rank={rank} pid={os.getpid()} world={world}")
    if step % 500 == 0:
        say(f"progress rank={rank} step={step}")
say(f"done rank={rank} steps={step}")
while args.linger:
    time.sleep(0.2)  # ok-sleep: idle in Python after training, for the tables to be read
dist.destroy_process_group()
