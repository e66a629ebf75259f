"""Training loops that stress the probe's torch hooks; prints ``ready`` when done, then waits.

--kind inplace: an MLP with nn.ReLU(inplace=True), two models and two optimizers, gradient
accumulation over 2 micro-batches and a torch.no_grad evaluation pass every step.
--kind broken: the same loop, with the probe's grad-norm and loss look-up made to raise.
--kind explicit: no optimizer at all; the loop calls probe.step(loss=..., samples=...).
--kind compiled: the inplace loop with the encoder under torch.compile(fullgraph=True) (eager
backend: dynamo traces the probe's hooks, no C++ compiler needed); prints ``graph_breaks N``.
Prints ``losses`` (the last micro-batch's loss of each step, for comparing runs with and without
the probe), ``step_losses`` (each step's loss: the mean over its micro-batches, what was backpropagated) and
``hooks step=N forward=K`` (global forward hooks seen inside each step).
"""

import argparse
import os
import time
import warnings

import torch
import torch.nn as nn

if os.environ.get("TARGET_NO_PROBE") != "1":
    import probe.auto  # noqa: F401

p = argparse.ArgumentParser()
p.add_argument("--kind", default="inplace")
p.add_argument("--steps", type=int, default=12)
args = p.parse_args()

if args.kind == "broken":
    import probe.training.capture as tc

    def broken(*a, **k):
        raise RuntimeError("injected failure in a probe hook")

    tc.Capture.grad_norm = broken
    tc.Capture.take = broken

torch.manual_seed(0)
torch.set_num_threads(1)
encoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(inplace=True), nn.Linear(32, 32), nn.ReLU(inplace=True))
head = nn.Sequential(nn.Linear(32, 1))
opt_enc = torch.optim.SGD(encoder.parameters(), lr=0.05, momentum=0.9)
opt_head = torch.optim.Adam(head.parameters(), lr=0.01)
x_all = torch.randn(256, 8)
y_all = x_all.sum(dim=1, keepdim=True)
encoder_fwd = encoder
if args.kind == "compiled":
    encoder_fwd = torch.compile(encoder, backend="eager", fullgraph=True)
mm = torch.nn.modules.module
losses, step_losses = [], []
for step in range(1, args.steps + 1):
    idx = torch.arange(step * 16, step * 16 + 32) % 256
    step_loss = 0.0
    for micro in range(2):
        xb, yb = x_all[idx[micro * 16 : (micro + 1) * 16]], y_all[idx[micro * 16 : (micro + 1) * 16]]
        loss = nn.functional.mse_loss(head(encoder_fwd(xb)), yb)
        (loss / 2).backward()
        step_loss += loss.item() / 2
    print(f"hooks step={step} forward={len(mm._global_forward_hooks)}", flush=True)
    if args.kind == "compiled":
        warnings.warn("the loop's own warning, shown once by Python's default filter", stacklevel=1)
    with torch.no_grad():
        head(encoder(x_all[:8]))  # an evaluation pass
    if args.kind == "explicit":
        with torch.no_grad():
            for prm in list(encoder.parameters()) + list(head.parameters()):
                prm -= 0.05 * prm.grad
                prm.grad = None
        import probe

        probe.step(loss=loss, samples=32)
    else:
        opt_head.step()  # the first optimizer to step leads the step count
        opt_enc.step()
        opt_enc.zero_grad(set_to_none=True)
        opt_head.zero_grad(set_to_none=True)
    losses.append(loss.item())
    step_losses.append(step_loss)
print("losses " + " ".join(f"{v:.6f}" for v in losses), flush=True)
print("step_losses " + " ".join(f"{v:.8f}" for v in step_losses), flush=True)
if args.kind == "compiled":
    from torch._dynamo.utils import counters

    print(f"graph_breaks {sum(counters['graph_break'].values())}", flush=True)
print(f"ready pid={os.getpid()}", flush=True)
while os.environ.get("TARGET_NO_PROBE") != "1":
    time.sleep(0.2)  # ok-sleep: the target idles until the test ends it
