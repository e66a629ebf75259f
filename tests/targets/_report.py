"""What the framework and hand-written loop targets print after each step (shared by them).

``snapshot(params)`` before the optimizer step and ``report(...)`` after it print
``[PREFIX]step N loss X lr Y used Z`` (Z: the lr the step really used, measured from a plain
SGD update as -(dp . g) / (g . g) over all parameters), ``ready`` after step 1, and pause
while the stall file exists (``stalled at step N`` / ``resumed at step N``).
"""

import os
import time


def snapshot(params):
    """(parameter, value before the step, its gradient) for the parameters that have a gradient."""
    return [(q, q.detach().clone(), q.grad.detach().clone()) for q in params if q.grad is not None]


def used_lr(before) -> float:
    num = sum(float(((b - q.detach()) * g).sum()) for q, b, g in before)
    den = sum(float((g * g).sum()) for _, _, g in before)
    return num / den if den else float("nan")


def report(step, loss, lr, before, stall_file=None, prefix=""):
    print(f"{prefix}step {step} loss {loss!r} lr {lr!r} used {used_lr(before)!r}", flush=True)
    step_done(step, stall_file)


def step_done(step, stall_file=None):
    """``ready`` after step 1; pause while the stall file exists."""
    if step == 1:
        print(f"ready pid={os.getpid()}", flush=True)
    if stall_file and os.path.exists(stall_file):
        print(f"stalled at step {step}", flush=True)
        while os.path.exists(stall_file):
            time.sleep(0.02)  # ok-sleep: a stalled training thread, released by the test
        print(f"resumed at step {step}", flush=True)
