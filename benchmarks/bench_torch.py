"""Cost of the torch hooks, measured side by side in one run (CPU).

1. Step-time overhead at the defaults (PROBE_TRACE sampling, step hook, lazy loss and
   grad norm) vs the probe's hooks absent: a launch-bound model (48 blocks of width 16)
   and a compute-bound one. Goal: <= 1 %.
2. Full tracing (every module call hooked): added time per module call, vs the floor of
   an empty global forward pre/post hook pair. Goal: <= 1.5x the floor.
3. The seed "slow training" query over a full 100k-row python.torch_trace, server side
   (snapshot + DuckDB). Goal: <= 50 ms.

    python benchmarks/bench_torch.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def launch_bound():
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.LayerNorm(16)) for _ in range(48)]
    return nn.Sequential(*blocks, nn.Linear(16, 1)), (torch.randn(8, 16), torch.randn(8, 1))


def compute_bound():
    return nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024), nn.GELU(), nn.Linear(1024, 1)), \
        (torch.randn(256, 1024), torch.randn(256, 1))


def train(model, opt, data, steps: int) -> list[float]:
    x, y = data
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def trimmed_mean(xs: list[float], cut: float = 0.05) -> float:
    xs = sorted(xs)
    return statistics.fmean(xs[: max(1, int(len(xs) * (1 - cut)))])


def interleaved(make, block: int, rounds: int, probe_on, probe_off) -> tuple[list, list]:
    """Step times with the hooks off and on, in alternating blocks of ``block`` steps on one model.

    Each "on" block starts a fresh probe (its step 1-3 are traced: dropped, as in a long run they
    are a one-off); the rest of the block holds the steady state, including its sampled step
    (step 100 at the default rate when block >= 100).
    """
    model, data = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, data, 10)
    off, on = [], []
    for _ in range(rounds):
        probe_off()
        off += train(model, opt, data, block)[3:]
        probe_on()
        on += train(model, opt, data, block)[3:]
    probe_off()
    return off, on


def per_call(model, x, reps: int) -> float:
    with torch.no_grad():
        model(x)
        t0 = time.perf_counter()
        for _ in range(reps):
            model(x)
    return (time.perf_counter() - t0) / reps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    from probe import _torch_hooks

    def on_():
        _torch_hooks.arm()

    def off_():
        _torch_hooks.disarm()

    print("1. step time, defaults (PROBE_TRACE unset) vs hooks absent")
    for name, make, block in (("launch-bound 48x16", launch_bound, 100), ("compute-bound 1024x2048", compute_bound, 20)):
        off, on = interleaved(make, block, args.rounds, on_, off_)
        m_off, m_on = statistics.median(off), statistics.median(on)
        a_off, a_on = trimmed_mean(off), trimmed_mean(on)
        print(f"   {name:24s} median off {m_off * 1e3:8.3f} ms on {m_on * 1e3:8.3f} ms ({100 * (m_on / m_off - 1):+5.2f} %)"
              f"   trimmed mean off {a_off * 1e3:8.3f} ms on {a_on * 1e3:8.3f} ms ({100 * (a_on / a_off - 1):+5.2f} %)")

    print("2. full tracing, added time per module call (forward, no_grad, launch-bound model)")
    model, (x, _) = launch_bound()
    calls = sum(1 for _ in model.modules())
    reps = 300
    base = min(per_call(model, x, reps) for _ in range(3))
    mm = torch.nn.modules.module
    h = [mm.register_module_forward_pre_hook(lambda m, a: None), mm.register_module_forward_hook(lambda m, a, o: None)]
    floor = min(per_call(model, x, reps) for _ in range(3)) - base
    for x_ in h:
        x_.remove()
    from probe._torch_trace import Tracer

    tracer = Tracer(torch, every=1, capacity=1_000_000)
    tracer.prepare(1)
    traced = min(per_call(model, x, reps) for _ in range(3)) - base
    tracer.close()
    print(f"   empty hook pair floor {floor / calls * 1e6:6.2f} us/call   probe tracing {traced / calls * 1e6:6.2f} us/call"
          f"   ratio {traced / floor:4.2f}x  (+ flush at step end, not counted)")

    print("3. seed slow-training query over a full 100k-row python.torch_trace")
    import numpy as np

    from probe._routes import run_query
    from probe._torch_trace import extend

    _torch_hooks.arm()
    tr = _torch_hooks.tracer()
    n = tr.ring.capacity
    rng = np.random.default_rng(0)
    names = np.array([f"blocks.{i}.mlp.{j}" for i in range(48) for j in range(3)], dtype=object)
    extend(tr.ring, {"step": np.repeat(np.arange(n // 500), 500)[:n].astype("i8"), "seq": np.arange(n) % 500,
                     "module": names[np.arange(n) % len(names)], "stage": np.full(n, "forward", dtype=object),
                     "duration": rng.random(n) * 1e-4, "allocated": rng.random(n) * 1e9, "max_allocated": np.full(n, 1e9),
                     "time": time.time() + np.arange(n) * 1e-5, "rank": np.full(n, np.nan), "depth": np.ones(n, "i8"),
                     "model": np.full(n, "model", dtype=object), "module_type": np.full(n, "Linear", dtype=object)}, n)
    sql = ("SELECT module, stage, COUNT(*) as count, AVG(duration) as avg_time, SUM(duration) as total_time "
           "FROM python.torch_trace WHERE step > (SELECT MAX(step) - 5 FROM python.torch_trace) "
           "GROUP BY module, stage ORDER BY total_time DESC LIMIT 10")
    run_query(sql)
    samples = []
    for _ in range(10):
        t0 = time.perf_counter()
        run_query(sql)
        samples.append(time.perf_counter() - t0)
    print(f"   rows {len(tr.ring)}   median {statistics.median(samples) * 1e3:6.1f} ms   best {min(samples) * 1e3:6.1f} ms (goal 50 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
