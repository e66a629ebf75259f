"""A GPT-shaped model trained on one device by a loop that never makes the host wait for the device.

Written as a GPU user writes it, with no probe code (run it with PROBE=1): data drawn on the device, the loss and
the clipped gradient norm kept on the device in preallocated tensors (no ``.item()``), AdamW, a LambdaLR warm-up,
optional autocast (bf16, or fp16 with a GradScaler) and torch.compile. It reads nothing back from the device until
its last step (``--steps``), so every host-device sync seen while it trains is someone else's.

Prints ``ready pid=N`` after step 1 and ``step N`` every ``--print-every`` steps (a counter, no tensor read). After
``--steps`` steps (0: train until killed) it synchronises once, writes ``--report`` (JSON: the loop's own loss and
gradient norm of every step, each step's time from CUDA events recorded by the loop, the steps a GradScaler skipped,
the sync warnings seen and where, dynamo's counters) and prints ``done``; with ``--linger`` it then idles in Python
so its tables can still be read.

``--sync-watch``: torch's sync debug mode on "warn" for the whole run; every warning is kept with the Python stack
it was raised from (probe leaves a mode the job set alone, so its own watch stays off).
``--leak-mb M``: keep M MB more every step (a leak). ``--oom-at S``: ask for twice the device's memory at step S.
``--overflow-at S`` (fp16): set the GradScaler's scale to 2**40 before step S, so the fp16 gradients overflow and the
scaler skips updates (halving its scale each time) until the scale fits again; the loop reads the scale after each
step to list the skipped steps (a sync of its own, on fp16 runs only).
``--resume PATH``: probe.load_checkpoint(PATH) first and go on from the step it holds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import traceback
import warnings

import torch
import torch.nn.functional as F
from _gpt import GPT

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda")
p.add_argument("--steps", type=int, default=0)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--width", type=int, default=128)
p.add_argument("--seq", type=int, default=64)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none")
p.add_argument("--compile", action="store_true")
p.add_argument("--sync-watch", action="store_true")
p.add_argument("--leak-mb", type=float, default=0.0)
p.add_argument("--oom-at", type=int, default=0)
p.add_argument("--overflow-at", type=int, default=0)
p.add_argument("--resume", default=None)
p.add_argument("--report", default=None)
p.add_argument("--linger", action="store_true")
p.add_argument("--print-every", type=int, default=50)
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()

dev = torch.device(args.device)
cuda = dev.type == "cuda"
VOCAB = 256

syncs: list[dict] = []  # every sync warning: the thread it came from and its Python stack


def _keep_sync(message, category, filename, lineno, file=None, line=None):
    if "synchronizing CUDA operation" not in str(message):
        return _showwarning(message, category, filename, lineno, file, line)
    syncs.append(
        {
            "thread": threading.current_thread().name,
            "main": threading.current_thread() is threading.main_thread(),
            "stack": [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]],
        }
    )


if args.sync_watch and cuda:
    _showwarning = warnings.showwarning
    warnings.showwarning = _keep_sync
    warnings.filterwarnings("always", message=".*synchronizing CUDA operation")
    torch.cuda.set_sync_debug_mode("warn")


torch.manual_seed(args.seed)
model = GPT(VOCAB, args.width, args.layers, args.seq).to(dev)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))
scaler = torch.amp.GradScaler(dev.type) if args.amp == "fp16" else None
forward = torch.compile(model) if args.compile else model
amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)

first = 1
if args.resume:
    import probe

    state = probe.load_checkpoint(args.resume, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    first = int(state["step"]) + 1
    print(f"resumed at step {first - 1}", flush=True)

keep = args.steps if args.steps else 10000  # the per-step records a run without an end keeps (a ring)
losses = torch.zeros(keep + 1, device=dev)
norms = torch.zeros(keep + 1, device=dev)
scales = torch.zeros(keep + 1, device=dev)
events = [torch.cuda.Event(enable_timing=True) for _ in range(keep + 2)] if cuda else []
leak: list = []


def batch():
    idx = torch.randint(0, VOCAB, (args.batch, args.seq + 1), device=dev)
    return idx[:, :-1], idx[:, 1:]


def train_step(step: int):
    x, y = batch()
    with torch.autocast(dev.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        logits = forward(x)
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, norm


def report(last: int) -> None:
    if cuda:
        torch.cuda.synchronize()
    n = last - first + 1
    times = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(n)] if cuda else []
    counters = {}
    if args.compile:
        from torch._dynamo.utils import counters as dc

        counters = {
            "frames": dc["frames"]["total"],
            "graphs": dc["stats"]["unique_graphs"],
            "graph_breaks": sum(dc["graph_break"].values()),
        }
    out = {
        "first": first,
        "last": last,
        "loss": [float(v) for v in losses[1 : n + 1].tolist()],
        "grad_norm": [float(v) for v in norms[1 : n + 1].tolist()],
        "event_s": times,
        "skipped": [first + i for i, s in enumerate(scales[1 : n + 1].tolist()) if s < 0],
        "syncs": syncs,
        "dynamo": counters,
        "allocated": torch.cuda.memory_allocated(dev) if cuda else None,
        "reserved": torch.cuda.memory_reserved(dev) if cuda else None,
    }
    with open(args.report, "w") as f:
        json.dump(out, f, default=lambda v: None if isinstance(v, float) and not math.isfinite(v) else v)


def main() -> None:
    step = first
    if cuda:
        events[0].record()
    while not args.steps or step < first + args.steps:
        i = (step - first) % keep + 1
        scale_before = scaler.get_scale() if scaler is not None and step - first < keep else None
        if scaler is not None and step == args.overflow_at:
            scaler.update(2.0**40)
        loss, norm = train_step(step)
        if args.leak_mb:
            leak.append(torch.empty(int(args.leak_mb * 2**20), dtype=torch.uint8, device=dev))
            if sum(t.numel() for t in leak) > 32 * 2**30:
                leak.clear()
        if args.oom_at and step == args.oom_at:
            total = torch.cuda.get_device_properties(dev).total_memory if cuda else 2**50
            torch.empty(2 * total, dtype=torch.uint8, device=dev)  # the out-of-memory error, uncaught
        losses[i] = loss.detach()
        norms[i] = norm.detach()
        if scale_before is not None:  # a GradScaler that skips the step lowers its scale: marked with -1
            scales[i] = -1.0 if scaler.get_scale() < scale_before else 1.0
        if cuda:
            events[i].record()
        if step == first:
            print(f"ready pid={os.getpid()}", flush=True)
        if step % args.print_every == 0:
            print(f"step {step}", flush=True)
        step += 1
    if args.report:
        report(step - 1)
    print("done", flush=True)
    while args.linger:
        time.sleep(0.2)  # ok-sleep: idle in Python after training, so the tables can still be read


if __name__ == "__main__":
    main()
    sys.exit(0)
