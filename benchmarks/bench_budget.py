"""The probe's cost against step time at any step time (PROBE_STEP_BUDGET), side by side in one run (CPU).

For plain training loops of about 0.5, 1, 2, 10 and 100 ms per step (an MLP whose width is
calibrated to the step time; Adam and StepLR, like most small jobs) and for the tiny
HF Trainer and Lightning models of the tests (built from configs, generated data, no
downloads), one process per workload alternates blocks of steps between three arms:

* ``on``: the probe's hooks running at the defaults (a long run's steady state: the
  probe is armed once and its step count, budget and sampling run on across blocks);
* ``off`` and ``off2``: the hooks paused (``probe.training.hooks.pause``). ``off2`` is an
  A/A control: its ratio to ``off`` is this machine's noise in this run.

Blocks rotate (on/off/off2, then off/off2/on, ...) so drift hits the arms alike, and the
first step of each block is dropped (it pays for the switch). Per workload it prints the
ratio of median step times on/off and off2/off (the median over rounds of each round's
ratio, with the 25th-75th percentile spread over rounds), in wall-clock time and in the
training thread's CPU time (``time.thread_time``: the probe's work is CPU work on that
thread, and CPU time leaves out the waits for a core that dominate a shared machine's
noise), then the probe's own figure:
``probe_us`` from torch.steps (its boundary work per step, timed by itself) as a share of
step time, the share of steps it measured (the optional values), and the share of the "on"
steps that carry the loss and a memory reading (the core signals, on every step). For the plain
loops it also times the probe inside the step, at its entry points (``Edges``: the optimizer
step's pre- and post-hooks, the backward call up to autograd's engine and back, the forward
call), on minus off: intervals of microseconds that the machine's load barely moves, so they
resolve what the step-time ratio cannot. Goal: on/off <= 1.01 at every step time.
Where the A/A spread is wider than 1 %, the machine cannot resolve the goal and the
probe_us share is the steady figure.

Loops shaped as others write them (``shaped_loop``: 3 Linear layers with in-place ReLUs, Adam or SGD, a
StepLR or none, cross-entropy or MSE, 10 or 100 layers) vary what the plain loops keep fixed; the ``cold``
row alternates the arms from the probe's first step, so the first 5,000 steps (discovery scans, the budget's
first burst) are counted too.

    python benchmarks/bench_budget.py [--rounds 12] [--only WORKLOAD]   (--help lists them)
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from alternation import Alternation, Edges  # noqa: E402

WARMUP = 200  # framework steps before measuring: start-up, and most of the budget's initial burst


# -- plain loops --------------------------------------------------------------------------------------
def mlp(width: int, edges: Edges | None = None):
    """A plain training step; with ``edges``, timed at the probe's entry points (``Edges``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 100, gamma=0.99)
    x, y = torch.randn(64, width), torch.randn(64, 1)

    def step():
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()

    if edges is None:
        return step
    edges.watch(opt)
    ns = time.perf_counter_ns

    def timed_step():
        t0 = ns()
        out = model(x)
        t1 = ns()
        loss = nn.functional.mse_loss(out, y)
        opt.zero_grad(set_to_none=True)
        t2 = ns()
        loss.backward()
        t3 = ns()
        opt.step()
        t4 = ns()
        sched.step()
        edges.note(t0, t1, t2, t3, t4)

    return timed_step


def median_step(step, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrated(target_s: float, build=None):
    """The plain-loop step function (``build(width)``, default ``mlp``) whose median step time first reaches
    ``target_s`` (widths grow by √2)."""
    width = 16
    while True:
        step = (build or mlp)(width)
        median_step(step, 3)
        if median_step(step, max(3, min(30, int(0.2 / target_s)))) >= target_s or width >= 8192:
            return step, width
        width = int(width * 1.41)


def plain(target: float, block: int):
    def run(rounds: int) -> None:
        from probe.training import hooks

        _, width = calibrated(target)
        edges = Edges()  # its global pre-hook goes in before the probe's
        step = mlp(width, edges)
        hooks.arm()
        for _ in range(max(20, int(2.0 / target))):  # start-up, and 2 s to spend the budget's initial burst
            step()
        alt = Alternation(block, rounds if target < 0.05 else max(4, rounds // 2), edges)
        alt.run(step)
        alt.report(f"plain ~{target * 1e3:g} ms (w={width})")

    return run


# -- loops shaped as others write them --------------------------------------------------------------------
def shaped_loop(width: int, layers: int, optimizer: str, scheduler: bool, loss: str):
    """A loop as written outside the project: ``layers`` Linear layers with in-place ReLUs between them, Adam
    or SGD, a StepLR or none, cross-entropy over 10 classes or MSE, ``zero_grad()`` first (not set_to_none)."""
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(width, 10 if i == layers - 1 and loss == "ce" else width))
        if i < layers - 1:
            mods.append(nn.ReLU(inplace=True))
    model = nn.Sequential(*mods)
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-3)
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5) if scheduler else None
    crit = nn.CrossEntropyLoss() if loss == "ce" else nn.MSELoss()
    x = torch.randn(32, width)
    y = torch.randint(0, 10, (32,)) if loss == "ce" else torch.randn(32, width)

    def step():
        opt.zero_grad()
        out = model(x)
        value = crit(out, y)
        value.backward()
        opt.step()
        if sched is not None:
            sched.step()

    return step


def shaped(target: float, block: int, layers: int, optimizer: str, scheduler: bool, loss: str, cold: bool = False):
    """A ``shaped_loop`` at about ``target`` seconds a step; ``cold``: the arms alternate from the probe's first
    step on, over its first 5,000 steps (start-up, discovery and the budget's first burst counted), not after a
    warm-up."""

    def run(rounds: int) -> None:
        from probe.training import hooks

        build = functools.partial(shaped_loop, layers=layers, optimizer=optimizer, scheduler=scheduler, loss=loss)
        _, width = calibrated(target, build)
        step = build(width)
        hooks.arm()
        if cold:
            alt = Alternation(block, max(1, 5000 // (3 * block)))
        else:
            for _ in range(max(20, int(2.0 / target))):  # start-up, and 2 s to spend the budget's initial burst
                step()
            alt = Alternation(block, rounds)
        alt.run(step)
        what = f"{layers} Linear, {optimizer}, {'StepLR' if scheduler else 'no scheduler'}, {loss}"
        alt.report(f"{'first 5000 steps: ' if cold else ''}{what} ~{target * 1e3:g} ms (w={width})")

    return run


# -- frameworks -----------------------------------------------------------------------------------------
def hf(rounds: int, block: int = 30) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import tempfile

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from probe.training import hooks

    hf_logging.set_verbosity_error()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (4096, 16), generator=g)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    alt = Alternation(block, rounds)

    class Alternate(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == WARMUP:
                alt.start()
            elif state.global_step > WARMUP and not alt.tick():
                control.should_training_stop = True

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out,
            max_steps=10**6,
            per_device_train_batch_size=4,
            learning_rate=0.05,
            warmup_steps=5,
            logging_steps=10**6,
            optim="sgd",
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
        )
        hooks.arm()
        Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=[Alternate()]).train()
    alt.report("HF Trainer GPT-2 tiny")


def lightning(rounds: int, block: int = 60) -> None:
    import lightning.pytorch as pl

    from probe.training import hooks

    warnings.filterwarnings("ignore")
    alt = Alternation(block, rounds)

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            step = self.trainer.global_step
            if step == WARMUP * 4:
                alt.start()
            elif step > WARMUP * 4 and not alt.tick():
                self.trainer.should_stop = True

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.01 * s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 8, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    hooks.arm()
    trainer = pl.Trainer(
        max_steps=10**6,
        max_epochs=-1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), loader)
    alt.report("Lightning tiny")


WORKLOADS = {
    "plain0.5": plain(0.0005, 200),
    "plain1": plain(0.001, 100),
    "plain2": plain(0.002, 60),
    "plain10": plain(0.010, 20),
    "plain100": plain(0.100, 4),
    # loops shaped as others write them: the scheduler, the optimizer, the loss and the number of modules varied
    "mlp3-adam-steplr-ce0.5": shaped(0.0005, 200, 3, "adam", True, "ce"),
    "mlp3-adam-ce0.5": shaped(0.0005, 200, 3, "adam", False, "ce"),
    "mlp3-sgd-steplr-ce0.5": shaped(0.0005, 200, 3, "sgd", True, "ce"),
    "mlp3-adam-steplr-ce1": shaped(0.001, 100, 3, "adam", True, "ce"),
    "linear10-sgd-mse0.5": shaped(0.0005, 200, 10, "sgd", False, "mse"),
    "linear100-adam-steplr-ce2": shaped(0.002, 60, 100, "adam", True, "ce"),
    "cold-mlp3-adam-steplr-ce0.5": shaped(0.0005, 100, 3, "adam", True, "ce", cold=True),
    "hf": hf,
    "lightning": lightning,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--only", choices=sorted(WORKLOADS), help="run one workload (each runs in this process)")
    p.add_argument("--no-header", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if not args.no_header:
        print(
            "step-time ratios, median over rounds [25th-75th percentile]; goal on/off <= 1.010; off2/off is the noise"
        )
    for name, fn in WORKLOADS.items():
        if args.only in (None, name):
            if args.only is None:
                # one workload per process: each arms the probe once, and its optimizer leads the step count
                import subprocess

                subprocess.run(
                    [sys.executable, __file__, "--rounds", str(args.rounds), "--only", name, "--no-header"], check=False
                )
            else:
                fn(args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
