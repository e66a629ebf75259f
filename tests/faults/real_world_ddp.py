"""Distributed training errors from public reports, rewritten small for CPU (gloo) with synthetic data, each
beside its healthy twin: the same script with ``--fixed``. Several errors can share one job when they do not
interact (``--error`` repeats).

    PROBE=1 python -m torch.distributed.run --standalone --nproc-per-node 2 real_world_ddp.py \
        --error NAME [--error NAME2] [--fixed]

A small classifier (an encoder with batch norm, a head) wrapped in DistributedDataParallel, on generated
vectors of 4 classes, each rank its own shard. It never imports probe: run it with PROBE=1, as a user would.
Every rank prints ``ready rank=R pid=P world=W`` after its first step and ``onset rank=R step=S time=T`` at the
step the errors start to act (the healthy twin prints it at the same step), then trains until killed.

The errors (``DDP_ERRORS``, with the doctor rule that must name each, are in tests/faults/corpus.py):

* ``no_wrapper``: the loss-bearing forward runs through ``model.module`` on some steps, bypassing the DDP
  wrapper: its gradient all-reduce is armed in ``DDP.forward``, so those steps' backward averages nothing and
  each rank steps on its own gradients; the replicas silently drift apart.
  https://github.com/jingyaogong/minimind/issues/853 (fixed by https://github.com/jingyaogong/minimind/pull/854);
  TrainCheck's DDP weight-divergence invariant (OrderLab/TrainCheck).
* ``rank_local``: a checkpoint of one module is loaded on rank 0 only, after the model was wrapped: DDP
  broadcasts the weights once, at construction, so rank 1 trains on from other weights.
  https://discuss.pytorch.org/t/preferred-way-of-loading-checkpoint-with-ddp-training/187470 (DDP's docs:
  "never try to change your model's parameters after wrapping up your model with DistributedDataParallel").
* ``buffers``: ``broadcast_buffers=False`` with plain BatchNorm: each rank keeps running statistics of its own
  shard, so evaluation and a checkpoint saved by rank 0 depend on which rank made them.
  https://github.com/open-mmlab/mmdetection/issues/2539, https://github.com/pytorch/pytorch/issues/30718
* ``unused``: ``find_unused_parameters=True`` where every parameter is used: DDP walks the autograd graph
  after every forward for nothing. https://github.com/facebookresearch/swav/issues/63
  (DDP's own warning: "find_unused_parameters=True was specified in DDP constructor, but did not find any
  unused parameters in the forward pass").
* ``same_data``: no DistributedSampler: every rank reads the whole dataset in the same order (the same seed on
  every rank), so each step's batch is the same on all ranks and the job trains copies of one shard.
  https://github.com/Shark-NLP/DiffuSeq/issues/37, https://github.com/PatrickHua/SimSiam/issues/16
* ``same_data_dropout``: the same, in a job that seeds each rank with its rank (``seed + rank``, so that dropout
  and augmentation differ between ranks) and trains with dropout: the batches are the same on every rank but the
  losses are not, so only the inputs show it.
  https://github.com/binbinao/physicsnemo-from-zero-to-one/issues/143 (a DataLoader without a DistributedSampler
  under DDP: every rank sees the same data); the per-rank seed as https://github.com/facebookresearch/detr/issues/297
  and https://github.com/karpathy/nanoGPT/issues/22 explain it.
* ``uneven``: the ranks' shards hold different numbers of batches: the rank with fewer finishes its epoch and
  waits at the end-of-epoch barrier while the other waits in DDP's all-reduce of a batch it alone has: the
  job hangs. https://github.com/pytorch/pytorch/issues/33148,
  https://discuss.pytorch.org/t/best-practice-for-uneven-dataset-sizes-with-distributeddataparallel/67308
"""

from __future__ import annotations

import argparse
import os
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

ERRORS = ("no_wrapper", "rank_local", "buffers", "unused", "same_data", "same_data_dropout", "uneven")

p = argparse.ArgumentParser()
p.add_argument("--error", action="append", default=[], choices=ERRORS)
p.add_argument("--fixed", action="store_true", help="the healthy twin: the same loop with the errors fixed")
p.add_argument("--onset", type=int, default=40, help="the step the errors start to act at")
p.add_argument("--batches", type=int, default=60, help="batches per epoch (uneven: the last rank gets one fewer)")
p.add_argument("--step-sleep", type=float, default=0.01)
args = p.parse_args()
errors = set(args.error) if not args.fixed else set()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
CLASSES, DIM = 4, 16
centers = torch.randn(CLASSES, DIM) * 2


def shard(n_batches: int, seed: int, n: int = 32, offset: float | None = None) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    shift = rank * 0.5 if offset is None else offset  # each rank's shard its own
    for _ in range(n_batches):
        y = torch.randint(0, CLASSES, (n,), generator=gen)
        out.append((centers[y] + torch.randn(n, DIM, generator=gen) + shift, y))
    return out


same = errors & {"same_data", "same_data_dropout"}
common = shard(64, seed=7, offset=0.0) if same else None  # the whole dataset, the same on every rank


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(
            OrderedDict(fc1=nn.Linear(DIM, 32), bn=nn.BatchNorm1d(32), relu=nn.ReLU(), fc2=nn.Linear(32, 32))
        )
        self.drop = nn.Dropout(0.2) if "same_data_dropout" in args.error else nn.Identity()  # and in its twin
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.head(self.drop(F.relu(self.encoder(x))))


model = DDP(
    Net(), broadcast_buffers="buffers" not in args.error or args.fixed, find_unused_parameters="unused" in errors
)
if "same_data_dropout" in args.error:  # each rank its own dropout masks (DDP has made the weights the same)
    torch.manual_seed(100 + rank)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
head_ckpt = {k: v.clone() * 0.5 for k, v in model.module.head.state_dict().items()}  # "a checkpoint" of the head

batches = args.batches - (1 if "uneven" in errors and rank == world - 1 else 0)
step = 0
epoch = 0
while True:
    data = shard(batches, seed=1000 * epoch + rank)
    for x, y in data:
        step += 1
        if step == args.onset:
            print(f"onset rank={rank} step={step} time={time.time():.3f}", flush=True)
            if "rank_local" in args.error and (rank == 0 or args.fixed):  # fixed: every rank loads it
                model.module.head.load_state_dict(head_ckpt)
        if common is not None and step >= args.onset:  # no DistributedSampler: every rank reads the same batch
            x, y = common[step % len(common)]
        bypass = "no_wrapper" in errors and step >= args.onset and step % 2 == 1
        out = model.module(x) if bypass else model(x)  # bypass: as the RL trainers of minimind #853 did
        loss = F.cross_entropy(out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_sleep)  # ok-sleep: keeps the loop from starving the test on 2 cores
        if step == 1:
            print(f"ready rank={rank} pid={os.getpid()} world={world}", flush=True)
    epoch += 1
    if "uneven" in args.error:
        print(f"epoch done rank={rank} step={step} batches={batches}", flush=True)
    dist.barrier()  # the end of the epoch: every rank before the next (a checkpoint would be written here)
