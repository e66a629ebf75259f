"""A small seeded training loop for the guard's tests (``probe guard``, PROBE_GUARD).

Each iteration I prints ``iter I start DIGEST`` before its forward and ``iter I pre DIGEST`` just before
``optimizer.step()``, ``iter I post DIGEST`` after it (DIGEST: sha256 of the weights and the optimizer's momentum,
byte for byte). Faults, at iteration N (on ``--fault-rank`` only, when distributed):

    --poison-at N   one input of the batch is inf (the loss and the gradients go non-finite)
    --spike-at N    the batch is scaled by 1e4 (a single huge-loss batch: a gradient-norm spike)
    --break-at N    the first weight is set to inf before the forward (the weights are already bad)
    --spike-file F  as --spike-at, at the first iteration once F exists (then F is removed)

``--steps S`` stops after S iterations: prints ``finished finite=BOOL DIGEST`` and waits to be stopped.
Distributed (gloo, one process per rank) when WORLD_SIZE is set. Prints ``ready`` after the first step.
"""

import argparse
import hashlib
import os
import sys
import time

import torch

import probe.auto  # noqa: F401


def digest(model, optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            h.update(buf.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser()
    for name in ("--poison-at", "--spike-at", "--break-at", "--steps"):
        p.add_argument(name, type=int, default=0)
    p.add_argument("--fault-rank", type=int, default=0)
    p.add_argument("--spike-file")
    p.add_argument("--step-sleep", type=float, default=0.01)
    args = p.parse_args()
    global model, optimizer, scheduler
    rank = 0
    if os.environ.get("WORLD_SIZE"):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        model = torch.nn.parallel.DistributedDataParallel(net)
    else:
        torch.manual_seed(0)
        net = model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000, gamma=0.5)
    gen = torch.Generator().manual_seed(1 + rank)
    faulty = rank == args.fault_rank
    i = 0
    while not args.steps or i < args.steps:
        i += 1
        x = torch.randn(16, 8, generator=gen)
        y = x.sum(1, keepdim=True)
        print(f"iter {i} start {digest(net, optimizer)}", flush=True)
        if faulty and i == args.poison_at:
            x[0, 0] = float("inf")
            print(f"poisoned at {i}", flush=True)
        spike = args.spike_file and os.path.exists(args.spike_file)
        if faulty and (i == args.spike_at or spike):
            x = x * 1e4
            if spike:
                os.unlink(args.spike_file)
            print(f"spiked at {i}", flush=True)
        if faulty and i == args.break_at:
            with torch.no_grad():
                net[0].weight[0, 0] = float("inf")
            print(f"broke the weights at {i}", flush=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        print(f"iter {i} pre {digest(net, optimizer)}", flush=True)
        optimizer.step()
        print(f"iter {i} post {digest(net, optimizer)}", flush=True)
        scheduler.step()
        if i == 1:
            print(f"ready pid={os.getpid()} rank={rank}", flush=True)
        time.sleep(args.step_sleep)  # ok-sleep: pacing of the target's steps
    finite = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    print(f"finished finite={finite} {digest(net, optimizer)}", flush=True)
    while True:
        time.sleep(1)  # ok-sleep: stays up for the test's queries


if __name__ == "__main__":
    sys.exit(main())
