"""A small torch training loop whose objects are hostile to whoever reads them.

- ``sneaky``, a ``__main__`` global (and so a local of the loop, which runs at module level), has a ``__class__``
  property: each read prints ``__class__ read on THREAD`` with the reader's innermost frames;
- a thread named ``holder`` waits in ``hold`` whose frame holds a 100 MB bytes local, a 100 MB str local, an object
  whose ``__repr__`` builds 100 MB, and one whose ``__repr__`` blocks forever.

Prints ``ready``, then ``step N`` every ten steps.
"""

import os
import sys
import threading
import traceback

import torch

import probe.auto  # noqa: F401


class Sneaky:
    @property
    def __class__(self):
        where = "".join(traceback.format_stack(limit=6)[:-1])
        print(f"__class__ read on {threading.current_thread().name}:\n{where}", flush=True)
        return Sneaky


class HugeRepr:
    def __repr__(self):
        return "r" * 100_000_000


class BlockingRepr:
    def __repr__(self):
        threading.Event().wait()  # never set: whoever asks for this repr waits forever
        return "never"


def hold(ready):
    big_bytes = b"b" * 100_000_000
    big_str = "s" * 100_000_000
    huge = HugeRepr()
    blocking = BlockingRepr()
    ready.set()
    threading.Event().wait()
    return big_bytes, big_str, huge, blocking


held = threading.Event()
threading.Thread(target=hold, args=(held,), name="holder", daemon=True).start()
held.wait()

torch.manual_seed(0)
sneaky = Sneaky()
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 8), torch.randn(16, 1)
print(f"ready {os.getpid()}", flush=True)
step = 0
while True:
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    if step % 10 == 0:
        print(f"step {step}", flush=True)
    threading.Event().wait(0.005)  # ok-sleep: the target simulates slower steps
    sys.stdout.flush()
