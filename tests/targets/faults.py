"""A small classifier (8 classes, generated data) that trains with one planted fault, or none.

    python faults.py --fault healthy|nan_after_lr_jump|nan_from_data|frozen|lr_zero|not_in_optimizer|
                             slowdown|memory_growth|hang|data_wait|dead_relu|collapsed|host_sync|
                             vanishing|grad_zero|loss_spike|diverging|grad_inf|
                             no_zero_grad|zero_grad_misplaced|eval_mode

It never imports probe itself: tests start it with PROBE=1, as a user would. It prints
"ready" after ``--ready-step`` steps and "planted at step N" once the fault has had ``--settle`` steps to show, then
keeps training (or hanging) until killed.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import threading
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", default="healthy")
p.add_argument("--fault-step", type=int, default=40)
p.add_argument("--ready-step", type=int, default=20)
p.add_argument("--step-sleep", type=float, default=0.005)
p.add_argument("--device", default="cpu")
p.add_argument("--settle", type=int, default=60, help="steps after the fault before printing 'planted'")
p.add_argument(
    "--hide-loss-every",
    type=int,
    default=0,
    help="every K-th step backpropagates with explicit gradients and no `loss` variable: its loss is unknown (NULL)",
)
args = p.parse_args()

torch.manual_seed(0)
CLASSES, DIM = 8, 16
centers = (torch.randn(CLASSES, DIM) * 3).to(args.device)


def batch(n=64):
    y = torch.randint(0, CLASSES, (n,), device=args.device)
    return centers[y] + torch.randn(n, DIM, device=args.device), y


class SlowSamples(torch.utils.data.Dataset):
    """data_wait: a dataset whose samples take 0.5 ms or more each to read (a slow disk, decoding on the
    main thread), behind a DataLoader with no workers: 32 ms a batch at least (a sleep only gets longer
    under load), against about 0.5 ms in the model."""

    def __len__(self):
        return 1 << 30

    def __getitem__(self, i):
        time.sleep(0.0005)  # ok-sleep: the planted slow read (the main thread waits, it does not spin)
        y = torch.randint(0, CLASSES, ())
        return centers.cpu()[y] + torch.randn(DIM), y


loader = iter(torch.utils.data.DataLoader(SlowSamples(), batch_size=64)) if args.fault == "data_wait" else None

if args.fault == "vanishing":  # 8 sigmoid layers at the default init, no normalization: the first layers get ~nothing
    body = [nn.Linear(DIM, 32), nn.Sigmoid()] + [m for _ in range(6) for m in (nn.Linear(32, 32), nn.Sigmoid())]
    model = nn.Sequential(*body, nn.Linear(32, CLASSES)).to(args.device)
elif args.fault == "eval_mode":  # the same net with dropout and batch norm after its first layer
    model = nn.Sequential(
        nn.Linear(DIM, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, CLASSES),
    ).to(args.device)
else:
    model = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CLASSES)).to(
        args.device
    )
if args.fault == "frozen":  # "fine-tune only the head", with the head frozen by mistake too
    for param in model.parameters():
        param.requires_grad_(False)
    model[4].bias.requires_grad_(True)
params = [q for q in model.parameters() if q.requires_grad]
if args.fault == "not_in_optimizer":
    params = list(model[4].parameters())  # the body trains with no optimizer behind it
optimizer = torch.optim.SGD(params, lr=0.05 if args.fault != "lr_zero" else 0.0, momentum=0.9)
hoard = []
total = 0.0
corrupt = random.Random(1)  # loss_spike: which batches come from the corrupt shard
# On CPU nothing synchronises: host_sync raises, from its own line, the warning torch's sync debug mode
# raises there on CUDA (the same text, category and frame), a stand-in for the CUDA path.
SYNC_WARNING = (
    "called a synchronizing CUDA operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:150.)"
)
if args.fault == "host_sync":
    warnings.showwarning = lambda *a, **k: None  # on CUDA the untraced steps raise nothing: print nothing here either
step = 0
while True:
    step += 1
    if args.fault == "hang" and step == args.fault_step:
        ready = threading.Event()  # never set

        def wait_for_shard(ready=ready):  # a prefetch thread blocked forever, as a dead data source leaves it
            ready.wait()

        threading.Thread(target=wait_for_shard, name="prefetch", daemon=True).start()
        print("planted", flush=True)
        while True:
            time.sleep(1)  # ok-sleep: the planted hang (the main thread never returns)
    x, y = [t.to(args.device) for t in next(loader)] if loader is not None else batch()  # data_wait: from step 1
    if (
        args.fault == "loss_spike"
        and step >= args.fault_step
        and (step == args.fault_step or corrupt.random() < 1 / 15)
    ):
        y = y.clone()
        y[:8] = (y[:8] + 1) % CLASSES  # a corrupt shard: about one batch in 15 has 8 of its 64 labels wrong
    if args.fault == "dead_relu" and step == args.fault_step:
        with torch.no_grad():
            model[2].bias.fill_(-100.0)  # a bad init/update: every pre-activation of the second ReLU is negative
    if args.fault == "nan_from_data" and step >= args.fault_step:
        x[0, 0] = float("nan")
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    if args.fault == "grad_zero" and step >= args.fault_step:
        keep = (y == -100).float()  # a padding mask that keeps nothing (the ignore index compared the wrong way)
        loss = (F.cross_entropy(logits, y, reduction="none") * keep).sum() / keep.sum().clamp(min=1)
    if args.fault == "grad_inf" and step == args.fault_step:
        # a layer-wise gradient multiplier by hook (base lr / layer lr), for a layer whose own lr was set to 0:
        # the forward and this step's loss stay finite, the layer's gradient is Inf from this backward on
        ratio = torch.tensor(0.05) / torch.tensor(0.0)
        model[2].weight.register_hook(lambda g, ratio=ratio: g * ratio)
    if args.fault == "eval_mode" and step == args.fault_step:
        model.eval()  # an evaluation pass that never switched back (model.train() missing)
    if not (args.fault == "no_zero_grad" and step >= args.fault_step):  # the planted fault: zero_grad() dropped
        optimizer.zero_grad(set_to_none=False)
    if args.hide_loss_every and step % args.hide_loss_every == 0:
        hidden, loss = loss, None  # nothing named loss, and a backward with explicit gradients: no loss to read
        torch.autograd.backward(hidden, torch.ones_like(hidden))
    else:
        loss.backward()
    if args.fault == "nan_after_lr_jump" and step == args.fault_step:
        for g in optimizer.param_groups:
            g["lr"] = 1e4  # a schedule bug: the LR jumps 200 000x
    if args.fault == "zero_grad_misplaced" and step >= args.fault_step:
        optimizer.zero_grad()  # clears what backward just computed: the step below has no gradient to follow
    optimizer.step()
    if args.fault == "diverging" and step >= args.fault_step:
        with torch.no_grad():
            for q in params:
                q.mul_(1 - 0.1)  # weight decay by hand, without the lr factor: 10% of every weight gone each step
    if args.fault == "collapsed" and step >= args.fault_step:
        with torch.no_grad():
            model[2].weight.mul_(0.0)  # a pruning mask that prunes everything: layer 2 outputs its bias alone
    if args.fault == "host_sync" and step >= args.fault_step:
        total += loss.item() if loss.is_cuda else (warnings.warn(SYNC_WARNING, stacklevel=1) or loss.item())
    if args.fault == "slowdown" and step >= args.fault_step:
        time.sleep(0.15)  # ok-sleep: the planted throughput regression
    if args.fault == "memory_growth" and step >= args.fault_step:
        hoard.append(torch.ones(256 * 1024, device=args.device))  # 1 MiB a step kept alive: a leak
    if args.step_sleep:
        time.sleep(args.step_sleep)  # ok-sleep: keeps the loop from starving the test on 2 cores
    if step == args.ready_step:
        print(f"ready pid={os.getpid()} chance={math.log(CLASSES):.4f}", flush=True)
    if step == args.fault_step + args.settle and args.fault not in ("healthy", "hang"):
        print(f"planted at step {args.fault_step}, {args.settle} steps ago", flush=True)
