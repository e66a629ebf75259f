"""A job whose input pipeline is the bottleneck though it has DataLoader workers (run it with PROBE=1).

A Dataset that takes ``--sample-s`` (10 ms) per sample, batch 16, ``num_workers=2,
persistent_workers=True``: each worker needs ~160 ms a batch, so batches arrive in pairs (one
step waits ~160 ms, the next almost nothing) around a model of ~1 ms. Prints ``ready`` after
``--ready-step`` steps, then trains until stopped.
"""

import argparse
import os
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--sample-s", type=float, default=0.01)
p.add_argument("--ready-step", type=int, default=4)
args = p.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)


class SlowSamples(torch.utils.data.Dataset):
    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        time.sleep(args.sample_s)  # ok-sleep: decoding/augmenting a sample on the worker
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return x, x.sum(0, keepdim=True)


def main():
    loader = torch.utils.data.DataLoader(SlowSamples(), batch_size=16, num_workers=2, persistent_workers=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(loader, 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == args.ready_step:
            print(f"ready pid={os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
