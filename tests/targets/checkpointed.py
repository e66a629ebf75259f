"""A model two modules deep trained with activation checkpointing, no probe code (run it with PROBE=1).

``Net`` holds ``blocks.N`` (each ``ln``, ``fc1``, ``act``, ``fc2``) and a ``head``; its forward runs
every block through ``torch.utils.checkpoint.checkpoint`` (``--reentrant``: ``use_reentrant=True``,
else False), so backward runs each block's forward again. ``--no-checkpoint`` is the healthy twin.
Prints ``step N loss X`` each step, ``ready`` after step 1.
"""

import argparse
import time

import torch
from torch.utils.checkpoint import checkpoint
from _report import step_done

p = argparse.ArgumentParser()
p.add_argument("--reentrant", action="store_true")
p.add_argument("--no-checkpoint", action="store_true")
p.add_argument("--blocks", type=int, default=3)
p.add_argument("--step-sleep", type=float, default=0.0)
args = p.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class Net(torch.nn.Module):
    def __init__(self, d=16, n=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        for block in self.blocks:
            if args.no_checkpoint:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=args.reentrant)
        return self.head(x)


model = Net(n=args.blocks)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def main():
    g = torch.Generator().manual_seed(0)
    step = 0
    while True:
        x = torch.randn(8, 16, generator=g, requires_grad=args.reentrant)  # reentrant: an input needing grad
        loss = torch.nn.functional.mse_loss(model(x), x.detach().sum(1, keepdim=True))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        print(f"step {step} loss {float(loss.detach())!r}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)  # ok-sleep: pacing
        step_done(step)


if __name__ == "__main__":
    main()
