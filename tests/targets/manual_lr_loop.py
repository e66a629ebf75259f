"""Hand-written training loops as users write them: no probe code (run it with PROBE=1).

--kind manual: the loop computes a warmup+cosine LR itself and assigns ``g["lr"] = lr`` to
every group each iteration, and accumulates 2 micro-batches with ``(loss / accum).backward()``.
--kind amp: ``scaler.scale(loss).backward()`` with a GradScaler (CPU, bfloat16 autocast).
--kind closure: ``optimizer.step(closure)``, the loss computed and backpropagated in the closure.
--kind accelerate: an ``accelerate.Accelerator`` loop (prepared model, optimizer, LambdaLR).
Plain SGD without momentum, so the lr a step really used is measured from the update itself:
each step prints ``step N loss X lr Y used Z`` (X: the step's loss as the loop logs it, the
mean over its micro-batches; Y: the loop's lr; Z: -(dp . g) / (g . g) over all parameters).
Prints ``ready`` after step 1. ``--stall-file F`` pauses between steps while F exists.
"""

import argparse
import math
import time

import torch
from _report import report as _report, snapshot

p = argparse.ArgumentParser()
p.add_argument("--kind", default="manual")
p.add_argument("--stall-file")
p.add_argument("--step-sleep", type=float, default=0.0)
args = p.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)
# TOTAL is far beyond any test's steps: a schedule that went flat would make the loop's rewrites
# invisible (it would write back the very value probe restored), and the tests look at any step
BASE_LR, WARMUP, TOTAL, ACCUM = 0.05, 5, 1_000_000, 2


def lr_at(step):
    if step < WARMUP:
        return BASE_LR * (step + 1) / WARMUP
    t = min(1.0, (step - WARMUP) / (TOTAL - WARMUP))
    return 0.1 * BASE_LR + 0.9 * BASE_LR * 0.5 * (1 + math.cos(math.pi * t))


def batch(g):
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def main():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    params = list(model.parameters())
    if args.kind == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        optimizer = torch.optim.SGD(params, lr=BASE_LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        step = 0
        while True:
            x, y = batch(g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            lr = optimizer.param_groups[0]["lr"]
            before = snapshot(params)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if args.step_sleep:
                time.sleep(args.step_sleep)  # ok-sleep: pacing
            _report(step, float(loss.detach()), lr, before, args.stall_file)
    optimizer = torch.optim.SGD(params, lr=BASE_LR)
    scaler = torch.amp.GradScaler("cpu") if args.kind == "amp" else None
    step = 0
    while True:
        if args.kind == "manual":
            lr = lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            total = 0.0
            for _ in range(ACCUM):
                x, y = batch(g)
                loss = torch.nn.functional.mse_loss(model(x), y)
                (loss / ACCUM).backward()
                total += float(loss.detach()) / ACCUM
            before = snapshot(params)
            optimizer.step()
        elif args.kind == "amp":
            lr = optimizer.param_groups[0]["lr"]
            x, y = batch(g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            scaler.scale(loss).backward()
            total = float(loss.detach())
            scaler.unscale_(optimizer)
            before = snapshot(params)
            scaler.step(optimizer)
            scaler.update()
        elif args.kind == "closure":
            lr = optimizer.param_groups[0]["lr"]
            x, y = batch(g)
            seen = {}

            def closure(x=x, y=y, seen=seen):  # called by optimizer.step below, in this iteration
                optimizer.zero_grad()
                mse = torch.nn.functional.mse_loss(model(x), y)  # not named loss, as before (PROBE_LOSS_NAMES)
                mse.backward()
                seen["loss"] = float(mse.detach())
                seen["state"] = snapshot(params)
                return mse

            optimizer.step(closure)
            total = seen["loss"]
            before = seen["state"]
        else:
            raise SystemExit(f"unknown --kind {args.kind}")
        optimizer.zero_grad(set_to_none=False)
        step += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)  # ok-sleep: pacing
        _report(step, total, lr, before, args.stall_file)


if __name__ == "__main__":
    main()
