"""Silent training errors from public reports, rewritten small for CPU with synthetic data, each beside its
healthy twin (the same script with ``--fixed``).

    python real_world.py --errors NAME[,NAME...] [--fixed] [--next-dir DIR] [--reach N[,N...]]

A small image classifier (two conv blocks with batch norm, a classifier with dropout, an extra head) on
generated 12x12 images of 10 classes. It never imports probe: run it with PROBE=1, as a user would.

Several errors run in one process, one phase each, in the order given: a phase takes over the model's weights
from the phase before (so the loss goes on where it was), builds its own optimizer (and scheduler), trains
``--onset`` optimizer steps healthy, prints ``onset error=NAME step=S time=T`` (S: optimizer steps since the
process started, as torch.steps counts them), and from then on trains with the error (or, with ``--fixed``,
without it) until the file ``DIR/NAME`` appears (the test has seen what it waited for); then it prints
``phase-end error=NAME`` and goes on to the next. After the last phase it trains on until killed. It prints
``ready`` after a few steps. With ``--reach``, a phase prints ``reached error=NAME step=S`` once it has trained that
many steps past its onset (one count a phase, in the order of ``--errors``): a test waits for that line, not polls.

The errors (tests/faults/corpus.py gives the doctor rule that must name each, and docs/doctor.md the table):

* ``so_60335387``: ``optimizer.zero_grad()`` missing from the loop: the gradients of every step add up.
  https://stackoverflow.com/questions/60335387/pytorch-mnist-example-not-converge
  (TrainCheck-Evaluation-Workloads: silent-issue-detection/bug-reprod-scripts/stackoverflow-60335387)
* ``wekws_72``: the training executor never calls ``zero_grad()`` (there with Adam).
  https://github.com/wenet-e2e/wekws/pull/73 (fixes #72)
* ``forum_84911``: transfer learning where ``if "bn" not in name: param.requires_grad = False`` froze every
  layer but the batch norms (and the classifier too): only batch norm trains.
  https://discuss.pytorch.org/t/obtaining-abnormal-changes-in-loss-and-accuracy/84911
  (TrainCheck-Evaluation-Workloads: silent-issue-detection/bug-reprod-scripts/pytorch-forum-84911)
* ``fcn_57``: validation in the middle of an epoch sets ``model.eval()`` and training goes on without
  ``model.train()``: dropout off and batch norm frozen for the rest of the epoch.
  https://github.com/wkentaro/pytorch-fcn/issues/57 (fixed by https://github.com/wkentaro/pytorch-fcn/pull/56)
* ``hvpnet_5``: the optimizer's parameter list is built part by part and one module's parameters (there the
  CRF and the final fc) were never added: they get gradients and never change.
  https://github.com/zjunlp/HVPNeT/issues/5
* ``adapters_260``: an adapter added to the model after the optimizer was built: the optimizer never sees it.
  https://github.com/adapter-hub/adapters/issues/260
* ``nni_4521``: a pruning "speedup" replaces layers with new, smaller ones (weights copied) after the
  optimizer was built: the optimizer still holds the old layers' tensors, the new ones never train.
  https://github.com/microsoft/nni/issues/4521
* ``pytorch_54765``: the network is replaced by a new one (``net1 = Net2()``) and the optimizer, built over
  the old one, is kept. https://github.com/pytorch/pytorch/issues/54765
* ``torchmoji_21``: the loss is re-wrapped as a new leaf (``loss = Variable(loss, requires_grad=True)``) to
  silence "element 0 of tensors does not require grad": backward reaches no parameter, the loss stays flat.
  https://github.com/huggingface/torchMoji/issues/21
* ``forum_153740``: layers frozen (``requires_grad = False``) after the optimizer was built, their gradients
  zeroed rather than set to None (``zero_grad(set_to_none=False)``, the default then): momentum and weight
  decay keep moving the "frozen" weights. https://discuss.pytorch.org/t/why-there-is-still-a-small-change-in-frozen-layer-parameters/153740
* ``ivadomed_57``: ``CosineAnnealingLR(T_max=num_epochs)`` stepped at every batch: the rate runs through
  many cosine cycles instead of one decay. https://github.com/ivadomed/ivadomed/issues/57
* ``pytorch_65417``: ``OneCycleLR`` (its schedule in optimizer steps) stepped once an epoch (Lightning's
  default interval): only a sliver of the warm-up is ever followed. https://github.com/pytorch/pytorch/issues/65417
* ``m2_71``: the scheduler stepped per batch and again at every epoch's end.
  https://github.com/aimagelab/meshed-memory-transformer/issues/71
* ``pytorch_13494``: the same loss backpropagated twice (``retain_graph=True``): its gradients count twice.
  https://github.com/pytorch/pytorch/issues/13494
* ``farm_46``: a linear-decay schedule whose total step count was computed too small: the rate reaches 0
  before training ends (``Training beyond specified 't_total'``). https://github.com/deepset-ai/FARM/issues/46
* ``llama_scratch_5``: the model's forward ends in ``F.softmax`` and its output goes to ``F.cross_entropy``,
  which applies log_softmax itself: the outputs are squashed twice and the loss cannot fall far.
  https://github.com/bkitano/llama-from-scratch/issues/5
* ``agcn_4``: one branch's output is detached (``.detach()``) before it joins the rest, so the layers behind it
  (here the convolutional features) get no gradient and never train, while the classifier does.
  https://github.com/queenie88/A-GCN/issues/4
* ``prediff_32``: with gradient accumulation, ``zero_grad()`` runs at every micro-batch, outside the
  ``if`` that steps the optimizer: each step follows only its last micro-batch. https://github.com/gaozhihan/PreDiff/issues/32
* ``iterfcn_7``: ``next(iter(train_loader))`` inside the loop builds a new iterator every step, and without
  shuffling its first batch is the same every time: the model trains on one batch (there, one subject).
  https://github.com/leohsuofnthu/Pytorch-IterativeFCN/issues/7
* ``gpjax_96``: the training batch is drawn once and the step reuses it at every iteration (there, a dataset
  iterator evaluated once inside a compiled loop): the loss curve is smooth and the fit poor.
  https://github.com/thomaspinder/GPJax/issues/96 (fixed by https://github.com/thomaspinder/GPJax/pull/99)
* ``normface_4``: the training data is ordered by class and not shuffled, so every batch holds one label and each
  step pulls the features toward one class. https://github.com/happynear/NormFace/issues/4
* ``transferlearning_182``: an ImageFolder whose images all sit under one folder: every label the loader yields is
  0. https://github.com/jindongwang/transferlearning/issues/182
* ``halo_13``: the dataset builder added the labels after converting the codes, so every label of the built
  dataset is 0. https://github.com/btheodorou99/HALO_Inpatient/issues/13
* ``unet_468``: with autocast and a GradScaler, ``clip_grad_norm_`` runs on the still-scaled gradients (no
  ``scaler.unscale_(optimizer)`` before it; RMSprop as there). https://github.com/milesial/Pytorch-UNet/issues/468
  (fixed by https://github.com/milesial/Pytorch-UNet/pull/470)
* ``lightning_9599``: native AMP clips the gradients right after backward and unscales them only before the
  optimizer step: the clipping sees them 65,536 times too large and the loss converges very slowly (SGD here).
  https://github.com/Lightning-AI/pytorch-lightning/issues/9599
* ``deepspeed_697``: float16 mixed precision whose forward overflows on most batches (here three of four arrive
  unnormalized, values float16 cannot hold after the first convolution): GradScaler skips each of those steps and
  halves its scale, which falls toward 0 while the loop runs on and the model does not learn ("Overflow detected.
  Skipping step. Attempted loss scale: 1"). https://github.com/deepspeedai/DeepSpeed/issues/697,
  https://github.com/ymcui/Chinese-LLaMA-Alpaca/issues/534 ("Current loss scale already at minimum")
* ``lomo_50``: a rate far too small for an SGD-style update (LOMO fuses SGD into backward; 5e-5 there), from the
  phase's start (its onset marks the step it is judged from): the loss does not go down. https://github.com/OpenLMLab/LOMO/issues/50
* ``megatron_579``: a gradient norm far above the clipping threshold (some 2,500 against 1.0 there) clipped at
  every step: like a rate thousands of times smaller (SGD here, where the clipped norm sets the step).
  https://github.com/alibaba/Pai-Megatron-Patch/issues/579
* ``opennmt_805``: ``-optim adam`` with the learning rate left at its default of 1, meant for SGD (Adam's is 1e-3),
  from the phase's start: each of Adam's first steps moves every weight by about 1, the weights grow tens of times
  over, and perplexity stays high. https://github.com/OpenNMT/OpenNMT-py/issues/805
* ``langmodel_3``: a config file's learning rate of 1.0 given to Adam, from the phase's start: the loss does not go
  down (the fix: Adam's default 1e-3). https://github.com/rajveermalviya/language-modeling/issues/3
* ``dalle_230``: a DistributedSampler shuffles the training set, and ``set_epoch`` is never called: every epoch
  visits the samples in the first epoch's order (here one rank, ``num_replicas=1``, and 10 batches an epoch).
  https://github.com/lucidrains/DALLE-pytorch/pull/230, https://github.com/pytorch/pytorch/issues/31771
* ``barc_9``: every sample is prepared on the CPU when the loader reads it, with ``num_workers=0``: the training
  thread decodes and augments each batch itself, and here it also shares its core with another process (the test
  pins a CPU hog beside it): the job is input bound and starved at once. https://github.com/runa91/barc_release/issues/9
  ("data preparation is done on cpu and takes a while"; the twin keeps the prepared samples in memory)
* ``dope_88``: batches loaded on the training thread (``num_workers`` set to 0), on a shared core as ``barc_9``:
  the GPU there waited on every batch. https://github.com/NVlabs/Deep_Object_Pose/issues/88 (the twin: the data
  held in memory, as the thread's fix loaded it)
* ``kaggle_12``: the images are shuffled after the labels were taken from the raw table, so each image gets another
  image's label: the labels do not track the inputs and the model cannot beat chance on its own training data.
  https://github.com/Borda/kaggle_image-classify/pull/12
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time
import weakref
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ERRORS = (
    "so_60335387",
    "wekws_72",
    "forum_84911",
    "fcn_57",
    "hvpnet_5",
    "adapters_260",
    "nni_4521",
    "pytorch_54765",
    "torchmoji_21",
    "forum_153740",
    "ivadomed_57",
    "pytorch_65417",
    "m2_71",
    "pytorch_13494",
    "farm_46",
    "prediff_32",
    "llama_scratch_5",
    "agcn_4",
    "iterfcn_7",
    "gpjax_96",
    "normface_4",
    "transferlearning_182",
    "halo_13",
    "unet_468",
    "lightning_9599",
    "lomo_50",
    "megatron_579",
    "deepspeed_697",
    "opennmt_805",
    "langmodel_3",
    "kaggle_12",
    "dalle_230",
    "barc_9",
    "dope_88",
)
AMP = ("unet_468", "lightning_9599", "deepspeed_697")  # autocast (bfloat16 on CPU; deepspeed_697 float16), a GradScaler

p = argparse.ArgumentParser()
p.add_argument("--errors", required=True, help="comma-separated, run one phase each in this order")
p.add_argument("--fixed", action="store_true", help="the healthy twin: the same loop with the errors fixed")
p.add_argument("--onset", type=int, default=20, help="optimizer steps of each phase before its error acts")
p.add_argument("--next-dir", default=None, help="a phase ends when DIR/NAME exists (without: never)")
p.add_argument("--step-sleep", type=float, default=0.01)
p.add_argument("--reach", default=None, help="comma-separated step counts past each phase's onset to announce")
args = p.parse_args()
errors = args.errors.split(",")
reach = [int(n) for n in args.reach.split(",")] if args.reach else [None] * len(errors)
if len(reach) != len(errors):
    p.error(f"--reach gives {len(reach)} counts for {len(errors)} errors")
for e in errors:
    if e not in ERRORS:
        p.error(f"unknown error {e!r}; known: {', '.join(ERRORS)}")

torch.manual_seed(0)
CLASSES = 10
EPOCH = 10  # batches per epoch, for the schedulers
templates = torch.randn(CLASSES, 1, 12, 12)


def batch(n=32):
    y = torch.randint(0, CLASSES, (n,))
    return templates[y] + 0.5 * torch.randn(n, 1, 12, 12), y


class Decoded(torch.utils.data.Dataset):
    """barc_9, dope_88: samples prepared on the CPU when they are read (a decode and its augmentations: ``work``
    iterations of Python a sample, about a millisecond for 20,000), or with ``cached`` prepared once and kept."""

    def __init__(self, n: int, work: int, cached: bool):
        self.x, self.y = batch(n)
        self.work, self.cached = work, cached

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i]
        if not self.cached:
            acc = 0
            for k in range(self.work):  # the per-sample preparation, on the training thread (no workers)
                acc += k * k % 7
            x = x + 0.0 * acc
        return x, self.y[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            OrderedDict(
                conv1=nn.Conv2d(1, 8, 3, padding=1),
                bn1=nn.BatchNorm2d(8),
                relu1=nn.ReLU(),
                conv2=nn.Conv2d(8, 16, 3, padding=1),
                bn2=nn.BatchNorm2d(16),
                relu2=nn.ReLU(),
                pool=nn.AdaptiveAvgPool2d(4),
            )
        )
        self.classifier = nn.Sequential(
            OrderedDict(fc1=nn.Linear(256, 64), relu=nn.ReLU(), drop=nn.Dropout(0.2), fc2=nn.Linear(64, CLASSES))
        )
        self.head = nn.Linear(CLASSES, CLASSES)  # HVPNeT's extra layer on top (a CRF's transitions there)
        self.adapter = None  # adapters_260: added later
        self.cut = False  # agcn_4: the features' output detached

    def forward(self, x):
        f = self.features(x)
        if self.cut:
            f = f.detach()  # as A-GCN's adjacency matrix was: nothing behind it gets a gradient
        h = self.classifier(f.flatten(1))
        if self.adapter is not None:
            h = h + self.adapter(h)
        return self.head(h)


class Phase:
    """One error's phase: its model (the last phase's weights), optimizer, scheduler and loop."""

    def __init__(self, error: str, fixed: bool, state):
        self.error, self.fixed = error, fixed
        self.model = Net()
        if state is not None:
            self.model.load_state_dict(state, strict=False)
        self.local = 0  # this phase's optimizer steps
        self.sched = None
        opt_cls = torch.optim.Adam if error == "wekws_72" else torch.optim.SGD
        kw = {"lr": 1e-3} if error == "wekws_72" else {"lr": 0.02, "momentum": 0.9}
        if error == "lomo_50" and not fixed:
            kw["lr"] = 5e-5  # the rate the run was given
        if error in ("opennmt_805", "langmodel_3"):  # Adam at the rate SGD was given
            opt_cls, kw = torch.optim.Adam, {"lr": 1e-3 if fixed else 1.0}
        if error == "unet_468":
            opt_cls, kw = torch.optim.RMSprop, {"lr": 1e-5, "momentum": 0.9}  # its train.py's rate
        self.scaler = torch.amp.GradScaler("cpu") if error in AMP else None
        self.loader = self.batches = None  # iterfcn_7, normface_4: a DataLoader and the iterator the loop keeps
        if error == "iterfcn_7":
            self.loader = DataLoader(TensorDataset(*batch(640)), batch_size=32, shuffle=False)
        elif error == "normface_4":  # 64 samples of each class, in class order
            y = torch.arange(CLASSES).repeat_interleave(64)
            ordered = TensorDataset(templates[y] + 0.5 * torch.randn(len(y), 1, 12, 12), y)
            self.loader = DataLoader(ordered, batch_size=32, shuffle=True)
        elif error == "dalle_230":  # one rank of a distributed loader: its sampler shuffles by the epoch it is given
            data = TensorDataset(*batch(320))
            self.loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, 1, 0, shuffle=True))
        self.epoch = 0
        self.cached = None  # gpjax_96: the one batch drawn
        if error == "forum_153740":
            kw["weight_decay"] = 5e-4
        self.optimizer = opt_cls(self.model.parameters(), **kw)
        if error == "ivadomed_57":
            self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=100)  # 100 epochs
        if error == "farm_46":  # linear decay to 0 over t_total steps; the bug's t_total ends at the onset
            total = args.onset if not fixed else 100_000
            self.sched = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: max(0.0, (total - s) / total))

    @property
    def bug(self) -> bool:
        return not self.fixed and self.local >= args.onset

    def at_onset(self) -> None:
        e, m, fixed = self.error, self.model, self.fixed
        if e == "forum_84911" and not fixed:
            for name, param in m.named_parameters():
                if "bn" not in name:  # meant: freeze the backbone; matched everything but the batch norms
                    param.requires_grad = False
        elif e == "hvpnet_5":  # the optimizer rebuilt part by part for the next stage: the head left out
            params = list(m.features.parameters()) + list(m.classifier.parameters())
            self.optimizer = torch.optim.SGD(params if not fixed else m.parameters(), lr=0.02, momentum=0.9)
        elif e == "adapters_260":
            m.adapter = nn.Sequential(OrderedDict(down=nn.Linear(CLASSES, 4), up=nn.Linear(4, CLASSES)))
            if fixed:
                self.optimizer.add_param_group({"params": m.adapter.parameters()})
        elif e == "nni_4521":  # speedup: new, smaller layers with the kept weights copied in
            old = m.classifier.fc1
            m.classifier.fc1 = nn.Linear(256, 64)
            m.classifier.fc1.load_state_dict(old.state_dict())
            if fixed:
                self.optimizer = torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)
        elif e == "pytorch_54765":
            new = Net()
            new.load_state_dict(m.state_dict())
            self.model = new
            if fixed:
                self.optimizer = torch.optim.SGD(new.parameters(), lr=0.02, momentum=0.9)
        elif e == "forum_153740":
            for param in list(m.features.conv1.parameters()) + list(m.features.bn1.parameters()):
                param.requires_grad = False
                if fixed:
                    param.grad = None  # the thread's fix
        elif e == "pytorch_65417":
            self.sched = torch.optim.lr_scheduler.OneCycleLR(self.optimizer, max_lr=0.05, total_steps=EPOCH * 1000)
        elif e == "m2_71":
            self.sched = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / math.sqrt(max(s, 1)))
        elif e == "agcn_4" and not fixed:
            m.cut = True
        elif e == "normface_4" and not fixed:
            self.loader = DataLoader(self.loader.dataset, batch_size=32, shuffle=False)
            self.batches = None
        elif e == "gpjax_96" and not fixed:
            self.cached = batch()
        elif e in ("barc_9", "dope_88"):  # from the onset its batches come from a loader with no workers
            size, work = (32, 20000) if e == "barc_9" else (64, 10000)
            self.loader = DataLoader(Decoded(20 * size, work, cached=fixed), batch_size=size, shuffle=True)

    def draw(self):
        """The step's batch, as the phase's loop gets it."""
        e, bug = self.error, self.bug
        if self.loader is not None:
            if bug and e == "iterfcn_7":
                return next(iter(self.loader))  # a new iterator every step: its first batch
            if self.batches is not None:
                b = next(self.batches, None)
                if b is not None:
                    return b
            if e == "dalle_230" and self.fixed:
                self.epoch += 1
                self.loader.sampler.set_epoch(self.epoch)  # the fix: each epoch in its own order
            self.batches = iter(self.loader)  # the next epoch
            return next(self.batches)
        if self.cached is not None:
            return self.cached
        x, y = batch()
        if bug and e == "deepspeed_697" and self.local % 4:
            x = x * 1e5  # unnormalized: past float16's 65504 after the first convolution
        if bug and e == "kaggle_12":
            y = y[torch.randperm(len(y))]  # the labels of the raw order, the images shuffled
        if bug and e in ("transferlearning_182", "halo_13"):
            y = torch.zeros_like(y)  # every image under one folder / labels added after the conversion
        return x, y

    def amp_step(self, x, y) -> None:
        """One step under autocast and a GradScaler, clipping as the phase's loop does."""
        m, opt, scaler = self.model, self.optimizer, self.scaler
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16 if self.error == "deepspeed_697" else torch.bfloat16):
            loss = F.cross_entropy(m(x), y)
        scaler.scale(loss).backward()
        if not (self.bug and self.error in ("unet_468", "lightning_9599")):
            scaler.unscale_(opt)  # the fix: unscale before clipping
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    def step(self) -> None:
        """One optimizer step of the phase's loop."""
        e, m, opt = self.error, self.model, self.optimizer
        bug = self.bug
        if e == "fcn_57" and self.local % args.onset == 0 and self.local:  # validation in the middle of the epoch
            m.eval()
            with torch.no_grad():
                xv, yv = batch(64)
                F.cross_entropy(m(xv), yv)
            if self.fixed or self.local < args.onset:
                m.train()
        if e == "prediff_32":  # 4 micro-batches per optimizer step
            for _ in range(4):
                if bug:
                    opt.zero_grad()  # outside the `if` that steps: clears each micro-batch's gradient
                x, y = batch(8)
                (F.cross_entropy(m(x), y) / 4).backward()
            opt.step()
            if not bug:
                opt.zero_grad()
            return
        x, y = self.draw()
        if self.scaler is not None:
            self.amp_step(x, y)
            return
        if not (bug and e in ("so_60335387", "wekws_72")):
            opt.zero_grad(set_to_none=e != "forum_153740")
        out = m(x)
        if bug and e == "llama_scratch_5":
            out = F.softmax(out, dim=-1)  # "logits = F.softmax(a, dim=-1)", then cross_entropy(logits, ...)
        loss = F.cross_entropy(out, y)
        if bug and e == "torchmoji_21":
            loss = loss.detach().requires_grad_()  # Variable(loss, requires_grad=True)
        if bug and e == "pytorch_13494":
            loss.backward(retain_graph=True)
        loss.backward()
        if e == "megatron_579":  # a norm far above the threshold is clipped at every step (the fix: a threshold it
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-4 if bug else 10.0)  # rarely reaches)
        opt.step()
        s = self.sched
        if s is None:
            return
        if e == "ivadomed_57":
            if bug or (self.local + 1) % EPOCH == 0:  # the bug: at every batch; meant: once an epoch
                s.step()
        elif e == "pytorch_65417":
            if self.fixed or (self.local + 1) % EPOCH == 0:  # the bug: once an epoch; meant: every batch
                s.step()
        elif e == "m2_71":
            s.step()
            if bug and (self.local + 1) % EPOCH == 0:  # and again at the epoch's end
                s.step()
        else:
            s.step()


steps = 0
state = None
for i, error in enumerate(errors):
    phase = Phase(error, args.fixed, state)
    done = os.path.join(args.next_dir, error) if args.next_dir else None
    while True:
        if phase.local == args.onset:
            phase.at_onset()
            print(f"onset error={error} step={steps} time={time.time():.3f}", flush=True)
        model, optimizer, scheduler = (
            phase.model,
            phase.optimizer,
            phase.sched,
        )  # a script's globals, as users write them
        phase.step()
        phase.local += 1
        steps += 1
        time.sleep(args.step_sleep)  # ok-sleep: keeps the loop from starving the test on 2 cores
        if steps == 5:
            print(f"ready pid={os.getpid()}", flush=True)
        if reach[i] is not None and phase.local == args.onset + reach[i]:
            print(f"reached error={error} step={steps}", flush=True)
        if done is not None and phase.local > args.onset and os.path.exists(done) and i < len(errors) - 1:
            break
    state = {k: v for k, v in phase.model.state_dict().items() if not k.startswith("adapter.")}
    gone = weakref.ref(phase.optimizer)
    del phase, model, optimizer, scheduler
    gc.collect()
    print(f"phase-end error={error} optimizer-freed={gone() is None}", flush=True)
