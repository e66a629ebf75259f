"""The probe's cost on a GPU: a GPT-shaped model in bf16 at about 5, 20 and 100 ms a step, side by side in one run.

For each size (``tests/targets/_gpt.py``, AdamW, bf16 autocast, a loop that never reads the device), one process
starts the probe at its defaults (``import probe.auto``: server, hooks, memory reader), warms up, then alternates
blocks of steps between the arms of ``alternation.Alternation``: ``on`` (the hooks running), ``off`` (paused) and
``off2`` (paused again: the A/A arm, this run's noise). A block lasts about a second and a half; its first step is
dropped. Per size it prints the ratio of median step times on/off and off2/off (wall clock: a loop that never syncs
runs as fast as the device drains its queue, so the wall step time is the device's step time), the training
thread's CPU time ratio, and the device's busy share per arm (NVML's utilization, sampled every 0.1 s in the middle
of each block): a probe that made the host late would show as idle device time in the ``on`` arm.
Goal: on/off <= 1.01 at every size, and no busy share lost.

The server, its memory reader and its other threads run in every arm (only the hooks pause): their cost, if any,
is in all three arms alike and this benchmark does not see it; ``bench_foundation.py`` measures the idle server.

    python benchmarks/bench_gpu.py [--rounds 6] [--quick] [--only 5ms|20ms|100ms]

Skipped, with one line, where there is no CUDA device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "targets"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# name -> (width, layers, sequence length, batch): about 5, 20 and 100 ms a step on an H100/H200 in bf16; the batch
# is then scaled to the target (``calibrate``)
SIZES = {
    "5ms": (768, 6, 512, 8),
    "20ms": (1024, 12, 1024, 8),
    "100ms": (2048, 16, 1024, 12),
}
TARGET_S = {"5ms": 0.005, "20ms": 0.020, "100ms": 0.100}


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


class Busy:
    """The device's busy share (NVML utilization) sampled every 0.1 s, kept per arm of the block running."""

    def __init__(self, alt):
        import torch

        self.alt, self.torch = alt, torch
        self.samples: dict = {}
        self.ok = True
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-busy", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            try:
                i, n = self.alt.i, self.alt.n
                if i >= len(self.alt.plan) or n < self.alt.block // 3:  # the middle of a block only
                    continue
                arm = self.alt.plan[i][1]
                self.samples.setdefault(arm, []).append(self.torch.cuda.utilization())
            except Exception:
                self.ok = False
                return

    def line(self) -> str:
        if not self.ok or not self.samples:
            return "    device busy: n/a (NVML's utilization could not be read)"
        parts = [f"{arm} {statistics.fmean(v):5.1f} %" for arm, v in sorted(self.samples.items())]
        return "    device busy (NVML, mean of samples): " + ", ".join(parts)


def calibrate(name: str):
    """(step function, batch, step time) for ``name``, its batch scaled so that a step takes about its target."""
    import torch
    import torch.nn.functional as F
    from _gpt import GPT

    width, layers, seq, batch = SIZES[name]
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = GPT(50304, width, layers, seq).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    state = {"batch": batch}

    def step():
        b = state["batch"]
        idx = torch.randint(0, 50304, (b, seq + 1), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    timed(5)
    t = timed(10)
    state["batch"] = max(1, round(batch * TARGET_S[name] / t))
    timed(3)
    return step, state["batch"], timed(10)


def run_one(name: str, rounds: int) -> None:
    import probe.auto  # noqa: F401  (the probe at its defaults: server, hooks, memory reader)
    import torch
    from alternation import Alternation

    from probe.training import hooks

    torch.backends.cuda.matmul.allow_tf32 = True
    step, batch, t = calibrate(name)
    hooks.arm()
    for _ in range(max(20, int(3.0 / t))):  # 3 s with the probe on: start-up and the budget's first burst
        step()
    torch.cuda.synchronize()
    width, layers, seq, _ = SIZES[name]
    alt = Alternation(max(5, int(1.5 / t)), rounds)
    busy = Busy(alt)
    busy.thread.start()
    alt.run(step)
    torch.cuda.synchronize()
    busy.stop.set()
    alt.report(f"GPT {name} d={width} L={layers} T={seq} B={batch}")
    print(busy.line(), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="3 rounds (what `./run-tests --gpu` runs)")
    p.add_argument("--only", choices=sorted(SIZES))
    args = p.parse_args()
    if not _cuda():
        print("bench_gpu: skipped: no CUDA device here.")
        return 0
    rounds = 3 if args.quick else args.rounds
    if args.only:
        run_one(args.only, rounds)
        return 0
    import torch

    print(
        f"bench_gpu on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}: "
        "step-time ratios, median over rounds [25th-75th percentile]; goal on/off <= 1.010; off2/off is the noise",
        flush=True,
    )
    rc = 0
    for name in SIZES:  # one process per size: each arms the probe once
        done = subprocess.run([sys.executable, __file__, "--rounds", str(rounds), "--only", name], check=False)
        rc = rc or done.returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
