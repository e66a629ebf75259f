"""Start and stop the probe twice in one process around a few steps of a tiny model, and report what each stop
left behind: one JSON line per round, ``{"round": N, "steps": ..., "left": {what: [before, after]}}``.

Every torch hook probe may install is used while it runs: step 1 is traced (the module forward hooks), the loss
goes through ``torch.autograd.backward`` and ``clip_grad_norm_`` (the wrappers), the hang watchdog and the
periodic post-mortem snapshot run (the environment sets them), and an action waits for a step that never comes.
"""

import atexit
import faulthandler
import json
import os
import signal
import sys
import threading
import time

import torch

import probe
from probe.actions import queue
from probe.agent import lifecycle  # noqa: F401  (its one atexit and at-fork registration is made at import)
from probe.training import hooks
from probe.training import boundary

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 8)
module_hooks = torch.nn.modules.module
import torch.optim.optimizer as optim_hooks  # noqa: E402


def _wakeup_fd() -> int:
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    return fd


def what_is_installed() -> dict:
    """Everything a start could have changed in this process, as comparable values."""
    return {
        "module global hooks": {
            k: len(v) for k, v in vars(module_hooks).items() if k.startswith("_global_") and isinstance(v, dict)
        },
        "optimizer global hooks": [
            len(optim_hooks._global_optimizer_pre_hooks),
            len(optim_hooks._global_optimizer_post_hooks),
        ],
        "model hooks": sorted(
            (name, kind, len(getattr(m, kind)))
            for name, m in model.named_modules()
            for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
        ),
        "optimizer hooks": [len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)],
        "module call slots": sorted(name for name, m in model.named_modules() if "_compiled_call_impl" in vars(m)),
        "backward": repr(torch.autograd.backward),
        "clip_grad_norm_": repr(torch.nn.utils.clip_grad_norm_),
        "GradScaler.scale": repr(torch.amp.GradScaler.scale),
        "threads": sorted(t.name for t in threading.enumerate()),
        "signal handlers": {
            s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)
        },
        "wakeup fd": _wakeup_fd(),
        "atexit entries": atexit._ncallbacks(),
        "excepthooks": [repr(sys.excepthook), repr(threading.excepthook), repr(sys.exit)],
        "faulthandler": faulthandler.is_enabled(),
        "meta path": [repr(f) for f in sys.meta_path],
        "environment": sorted(k for k in os.environ if k.startswith(("TORCH", "PROBE"))),
        "entry and socket": sorted(
            f for f in os.listdir(os.environ["PROBE_RUNTIME_DIR"]) if f.endswith((".json", ".sock"))
        ),
        "step subscribers": [len(boundary.before), len(boundary.after), len(boundary.beats)],
    }


def train(steps: int) -> None:
    for _ in range(steps):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def left_behind(before: dict) -> dict:
    """What differs from ``before``; threads that a stop ended may take a moment to go."""
    deadline = time.monotonic() + 10
    while True:
        after = what_is_installed()
        left = {k: [before[k], after[k]] for k in before if before[k] != after[k]}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)  # ok-sleep: waiting for stopped threads to end


train(2)  # torch's own lazy state (optimizer state, autograd threads) exists before the first start
for round_ in (1, 2):
    before = what_is_installed()
    entry = probe.start()
    train(5)
    action = queue.submit("wait", lambda ctx: {}, args={}, client={}, at_step=10**9, timeout=600)
    running = what_is_installed()
    steps = hooks.tracker().step
    probe.stop()
    print(
        json.dumps(
            {
                "round": round_,
                "served": os.path.basename(entry["socket"]) in running["entry and socket"],
                "installed": sorted(k for k in before if before[k] != running[k]),
                "steps": steps,
                "action": action.state,
                "left": left_behind(before),
            }
        ),
        flush=True,
    )
