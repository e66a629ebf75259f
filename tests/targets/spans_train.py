"""A tiny training loop with nested user spans, for python.spans and the timeline.

Each step: ``step`` (outer) holds ``data`` and ``compute``; ``compute`` holds ``loss``
(a decorated function). A second thread records ``prefetch`` spans. Prints ``ready``
after the first step. ``--data-sleep S`` makes the data span S seconds (an input-bound job);
``--step-sleep S`` paces the steps (S seconds after each, outside every span).
"""

import argparse
import os
import threading
import time

import torch

import probe.auto  # noqa: F401
import probe


@probe.span("loss")
def loss_of(model, batch):
    return model(batch).pow(2).mean()


def prefetcher(stop):
    while not stop.is_set():
        with probe.span("prefetch"):
            time.sleep(0.005)  # ok-sleep: simulated I/O in a helper thread
        stop.wait(0.02)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-sleep", type=float, default=0.002, help="Seconds of simulated data loading per step.")
    p.add_argument("--step-sleep", type=float, default=0.01, help="Seconds of pacing after each step.")
    args = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stop = threading.Event()
    threading.Thread(target=prefetcher, args=(stop,), name="prefetcher", daemon=True).start()
    step = 0
    while True:
        with probe.span("step"):
            with probe.span("data"):
                batch = torch.randn(16, 8)
                time.sleep(args.data_sleep)  # ok-sleep: simulated data loading
            with probe.span("compute"):
                loss = loss_of(model, batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
        optimizer.step()
        step += 1
        if step == 1:
            print(f"ready pid={os.getpid()}", flush=True)
        time.sleep(args.step_sleep)  # ok-sleep: pacing


if __name__ == "__main__":
    main()
