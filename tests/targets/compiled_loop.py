"""A tiny model under torch.compile trained with no probe code (run it with PROBE=1).

``torch.compile(model, backend=--backend)`` (default ``eager``: dynamo's capture and guards, no C++
compiler); with ``--fullgraph-step`` the loss function that calls the model is compiled instead, with
``fullgraph=True`` (any graph break in it is an error). Prints ``step N loss X`` each step and ``ready`` after
step 1. ``dynamo()`` (for ``probe eval``) returns dynamo's counters: frames compiled, graphs, and the
recompilations seen by the recompile log hook (torch._logging's ``recompiles`` artifact), each with its reason.
"""

import argparse
import logging
import time

import torch
import torch._logging
from _report import step_done

p = argparse.ArgumentParser()
p.add_argument("--backend", default="eager")
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--fullgraph-step", action="store_true", help="compile the step's loss function, fullgraph=True")
args = p.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)

recompiles: list[str] = []


class _Recompiles(logging.Handler):
    def emit(self, record):
        recompiles.append(record.getMessage())


torch._logging.set_logs(recompiles=True)
_log = logging.getLogger("torch._dynamo.guards.__recompiles")  # torch._logging's recompiles artifact
_log.addHandler(_Recompiles())
_log.propagate = False  # kept here, not printed


def dynamo():
    from torch._dynamo.utils import counters

    return {
        "frames": counters["frames"]["total"],
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": len(recompiles),
        "reasons": recompiles[-3:],
    }


model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
compiled = torch.compile(model, backend=args.backend) if not args.fullgraph_step else model
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def loss_of(x):
    return torch.nn.functional.mse_loss(compiled(x), x.sum(1, keepdim=True))


if args.fullgraph_step:
    loss_of = torch.compile(loss_of, backend=args.backend, fullgraph=True)


def main():
    g = torch.Generator().manual_seed(0)
    step = 0
    while True:
        x = torch.randn(16, 8, generator=g)
        loss = loss_of(x)
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
