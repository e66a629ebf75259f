"""Silent training errors from public reports, rewritten small for CPU with synthetic data, each beside its
healthy twin: the same script with ``--fixed``.

    python real_world.py --error NAME [--fixed]

A small image classifier (two conv blocks with batch norm, a classifier with dropout, an extra head) on
generated 12x12 images of 10 classes. It never imports probe: run it with PROBE=1, as a user would. It prints
``ready`` after a few steps and ``onset step=S time=T`` at the step the error starts to act (the healthy twin
prints it at the same step), then trains until killed.

The errors (``ERRORS``, with the doctor rule that must name each, are in tests/faults/corpus.py):

* ``so_60335387``: ``optimizer.zero_grad()`` missing from the loop: the gradients of every step add up.
  https://stackoverflow.com/questions/60335387/pytorch-mnist-example-not-converge
  (TrainCheck-Evaluation-Workloads: silent-issue-detection/bug-reprod-scripts/stackoverflow-60335387)
* ``forum_84911``: transfer learning where ``if "bn" not in name: param.requires_grad = False`` froze every layer
  but the batch norms (and the classifier too): only batch norm trains.
  https://discuss.pytorch.org/t/obtaining-abnormal-changes-in-loss-and-accuracy/84911
  (TrainCheck-Evaluation-Workloads: silent-issue-detection/bug-reprod-scripts/pytorch-forum-84911)
* ``fcn_57``: validation in the middle of an epoch sets ``model.eval()`` and training goes on without
  ``model.train()``: dropout off and batch norm frozen for the rest of the epoch.
  https://github.com/wkentaro/pytorch-fcn/issues/57 (fixed by https://github.com/wkentaro/pytorch-fcn/pull/56)
* ``hvpnet_5``: the optimizer's parameter list is built part by part and one module's parameters (there the
  CRF and the final fc) were never added: they get gradients and never change.
  https://github.com/zjunlp/HVPNeT/issues/5
"""

from __future__ import annotations

import argparse
import os
import time
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--error", required=True, choices=["so_60335387", "forum_84911", "fcn_57", "hvpnet_5"])
p.add_argument("--fixed", action="store_true", help="the healthy twin: the same loop with the error fixed")
p.add_argument("--onset", type=int, default=20, help="the step the error starts to act at")
p.add_argument("--step-sleep", type=float, default=0.01)
args = p.parse_args()

torch.manual_seed(0)
CLASSES = 10
templates = torch.randn(CLASSES, 1, 12, 12)


def batch(n=32):
    y = torch.randint(0, CLASSES, (n,))
    return templates[y] + 0.5 * torch.randn(n, 1, 12, 12), y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(OrderedDict(
            conv1=nn.Conv2d(1, 8, 3, padding=1), bn1=nn.BatchNorm2d(8), relu1=nn.ReLU(),
            conv2=nn.Conv2d(8, 16, 3, padding=1), bn2=nn.BatchNorm2d(16), relu2=nn.ReLU(), pool=nn.AdaptiveAvgPool2d(4)))
        self.classifier = nn.Sequential(OrderedDict(
            fc1=nn.Linear(256, 64), relu=nn.ReLU(), drop=nn.Dropout(0.2), fc2=nn.Linear(64, CLASSES)))
        self.head = nn.Linear(CLASSES, CLASSES)  # HVPNeT's extra layer on top (a CRF's transitions there)

    def forward(self, x):
        return self.head(self.classifier(self.features(x).flatten(1)))


model = Net()
error, fixed = args.error, args.fixed
if error == "forum_84911" and not fixed:
    for name, param in model.named_parameters():
        if "bn" not in name:  # meant: freeze the backbone; matched everything but the batch norms
            param.requires_grad = False
if error == "hvpnet_5" and not fixed:
    params = list(model.features.parameters()) + list(model.classifier.parameters())  # the head was never added
else:
    params = [q for q in model.parameters() if q.requires_grad]
optimizer = torch.optim.SGD(params, lr=0.02, momentum=0.9)

step = 0
while True:
    step += 1
    if step == args.onset:
        print(f"onset step={step} time={time.time():.3f}", flush=True)
    if error == "fcn_57" and step % args.onset == 0:  # validation in the middle of the epoch
        model.eval()
        with torch.no_grad():
            xv, yv = batch(64)
            F.cross_entropy(model(xv), yv)
        if fixed:
            model.train()
    x, y = batch()
    if not (error == "so_60335387" and not fixed and step >= args.onset):
        optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    time.sleep(args.step_sleep)  # ok-sleep: keeps the loop from starving the test on 2 cores
    if step == 5:
        print(f"ready pid={os.getpid()}", flush=True)
