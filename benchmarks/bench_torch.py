"""Cost of the torch hooks, measured side by side in one run (CPU).

1. Step-time overhead at the defaults (PROBE_TRACE sampling, step hook, lazy loss and
   grad norm) vs the probe's hooks absent: a launch-bound model (48 blocks of width 16)
   and a compute-bound one. Goal: <= 1 %. Shared machines are noisy at this scale, so the
   run also reports an A/A control arm and the time spent inside the hooks, measured
   directly (the part of the overhead that is the probe's own work).
2. Full tracing (every module call hooked): added time per module call, vs the floor of
   an empty global forward pre/post hook pair. Goal: <= 1.5x the floor.
3. The seed "slow training" query over a full 100k-row python.torch_trace, server side
   (snapshot + DuckDB). Goal: <= 50 ms.
4. A traced training step with the output statistics (out_* columns, PROBE_TRACE_STATS) vs
   the same traced step without them, and vs an untraced step; the flush at the step's end
   included. Untraced steps run no probe code added by the statistics (no hooks at all).
5. The doctor's rules over the statistics (dead_activations, collapsed_output) on a full
   100k-row python.torch_trace: plan, snapshot, DuckDB, as a doctor run does. Goal: well
   under the doctor's 5 s.

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # alternation.py


def launch_bound():
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.LayerNorm(16)) for _ in range(48)]
    return nn.Sequential(*blocks, nn.Linear(16, 1)), (torch.randn(8, 16), torch.randn(8, 1))


def compute_bound():
    return nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024), nn.GELU(), nn.Linear(1024, 1)), (
        torch.randn(256, 1024),
        torch.randn(256, 1),
    )


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


def interleaved(make, block: int, rounds: int) -> dict:
    """Step times in three arms on one model: hooks running ("on"), paused ("off") and paused
    again ("off2", the A/A control that shows this machine's noise in the same run).

    The alternation is alternation.py's (blocks rotating through the arms, the first step
    of each block dropped); the probe is armed once, so the "on" steps are a long run's
    steady state. Then, with the hooks running, the time spent inside the probe's own
    hooks is measured directly ("direct", seconds per step).
    """
    from alternation import Alternation
    from probe.training import hooks

    model, data = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, data, 10)
    hooks.arm()
    train(model, opt, data, 10)  # the start-up steps (traced, scanned) before any measurement
    alt = Alternation(block, rounds)
    alt.run(lambda: train(model, opt, data, 1))
    arms: dict = {arm: [t for block_times in alt.times[arm] for t in block_times] for arm in alt.times}
    hooks.resume()
    tk = hooks.tracker()
    inside = [0.0]

    def timed(fn):
        def wrapper(*a):
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                inside[0] += time.perf_counter() - t0

        return wrapper

    tk.on_optimizer_step = timed(tk.on_optimizer_step)
    tk.inputs.pre_hook = timed(tk.inputs.pre_hook)
    tk.capture.saw_backward = timed(tk.capture.saw_backward)
    tk.inputs.close()
    tk.watch_roots()
    n = len(arms["on"])
    wall = sum(train(model, opt, data, n))
    arms["direct"] = inside[0] / n
    arms["direct_share"] = inside[0] / wall
    hooks.disarm()
    return arms


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
    p.add_argument("--only", type=int, choices=(1, 2, 3, 4, 5), help="run one section")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.only in (None, 1):
        step_overhead(args.rounds)
    if args.only in (None, 2):
        tracing_per_call(args.rounds)
    if args.only in (None, 3):
        seed_query()
    if args.only in (None, 4):
        stats_cost(args.rounds)
    if args.only in (None, 5):
        stats_rules()
    return 0


def step_overhead(rounds: int) -> None:
    print("1. step time at the defaults: hooks running (on) vs paused (off); off2 is a second paused arm")
    print("   (an A/A control: its difference from off is this machine's noise in this run)")
    for name, make, block, n in (
        ("launch-bound 48x16", launch_bound, 6, 12 * rounds),
        ("compute-bound 1024x2048", compute_bound, 3, 8 * rounds),
    ):
        arms = interleaved(make, block, n)
        med = {k: statistics.median(arms[k]) for k in ("on", "off", "off2")}
        avg = {k: statistics.fmean(arms[k]) for k in ("on", "off", "off2")}
        print(f"   {name}: {len(arms['on'])} steps per arm, median step {med['off'] * 1e3:.3f} ms")
        print(
            f"      on vs off   median {100 * (med['on'] / med['off'] - 1):+5.2f} %   mean "
            f"{100 * (avg['on'] / avg['off'] - 1):+5.2f} %"
            f"   goal <= +1 %"
        )
        print(
            f"      off2 vs off median {100 * (med['off2'] / med['off'] - 1):+5.2f} %   mean "
            f"{100 * (avg['off2'] / avg['off'] - 1):+5.2f} %"
            f"   (noise)"
        )
        print(
            f"      time inside the probe's hooks: {arms['direct'] * 1e6:6.1f} us per step = "
            f"{100 * arms['direct_share']:4.2f} % of step time"
        )


def tracing_per_call(rounds: int) -> None:
    print("2. full tracing, added time per module call (forward, no_grad, launch-bound model)")
    model, (x, _) = launch_bound()
    calls = sum(1 for _ in model.modules())
    mm = torch.nn.modules.module
    from probe.training.trace import Tracer

    tracer = Tracer(torch, every=1, capacity=1_000_000)

    def empty_pair():
        return [
            mm.register_module_forward_pre_hook(lambda m, a: None),
            mm.register_module_forward_hook(lambda m, a, o: None),
        ]

    # Rounds of three adjacent measurements (no hooks, empty pair, probe), rotated; each round
    # gives paired differences, so drift between rounds cancels. Ratio of the median differences.
    d_empty, d_probe = [], []
    for r in range(40 * rounds):
        got = {}
        for arm in ("none", "empty", "probe")[r % 3 :] + ("none", "empty", "probe")[: r % 3]:
            if arm == "empty":
                handles = empty_pair()
                got[arm] = per_call(model, x, 10)
                for h in handles:
                    h.remove()
            elif arm == "probe":
                tracer.prepare(1)
                got[arm] = per_call(model, x, 10)
                tracer.close()
                tracer.rows.clear()
            else:
                got[arm] = per_call(model, x, 10)
        d_empty.append((got["empty"] - got["none"]) / calls)
        d_probe.append((got["probe"] - got["none"]) / calls)
    floor, traced = statistics.median(d_empty), statistics.median(d_probe)
    print(
        f"   empty hook pair floor {floor * 1e6:5.2f} us/call   probe tracing {traced * 1e6:5.2f} us/call"
        f"   ratio {traced / floor:4.2f}x  goal <= 1.5x  ({len(d_probe)} paired rounds)"
    )
    print("   (the flush at the step's end is not counted: it runs once per traced step, not per call)")


def run_query(sql: str):
    """The whole query path in one process: plan, snapshot (what the training process does), wire, client DuckDB."""
    from probe.agent.snapshot import take
    from probe.tables.registry import all_tables
    from probe.util.wire import decode
    from probe.sql.engine import Workspace
    from probe.sql.federate import plan
    from probe.sql.pushdown import rename_tables_sql, snapshot_requests

    schema = {t.name: {c.name: c.type for c in t.columns} for t in all_tables()}
    p = plan(sql, schema)
    decoded = decode(b"".join(bytes(b) for b in take({"tables": snapshot_requests(p.parts, schema)}, {})))
    with Workspace() as ws:
        ws.load_snapshot(0, decoded)
        for name, part in p.parts.items():
            ws.create_view(name, rename_tables_sql(part, ws.tables[0]))
        return ws.execute(p.outer)


def seed_query() -> None:
    from probe.training import hooks

    print("3. seed slow-training query over a full 100k-row python.torch_trace")
    import numpy as np

    hooks.arm()
    tr = hooks.tracer()
    n = tr.ring.capacity
    rng = np.random.default_rng(0)
    names = np.array([f"blocks.{i}.mlp.{j}" for i in range(48) for j in range(3)], dtype=object)
    tr.ring.extend(
        {
            "step": np.repeat(np.arange(n // 500), 500)[:n].astype("i8"),
            "seq": np.arange(n) % 500,
            "module": names[np.arange(n) % len(names)],
            "stage": np.full(n, "forward", dtype=object),
            "duration": rng.random(n) * 1e-4,
            "allocated": rng.random(n) * 1e9,
            "max_allocated": np.full(n, 1e9),
            "time": time.time() + np.arange(n) * 1e-5,
            "rank": np.full(n, np.nan),
            "depth": np.ones(n, "i8"),
            "model": np.full(n, "model", dtype=object),
            "module_type": np.full(n, "Linear", dtype=object),
        },
        n,
    )
    sql = (
        "SELECT module, stage, COUNT(*) as count, AVG(duration) as avg_time, SUM(duration) as total_time "
        "FROM python.torch_trace WHERE step > (SELECT MAX(step) - 5 FROM python.torch_trace) "
        "GROUP BY module, stage ORDER BY total_time DESC LIMIT 10"
    )
    run_query(sql)
    samples = []
    for _ in range(10):
        t0 = time.perf_counter()
        run_query(sql)
        samples.append(time.perf_counter() - t0)
    print(
        f"   rows {len(tr.ring)}   median {statistics.median(samples) * 1e3:6.1f} ms   "
        f"best {min(samples) * 1e3:6.1f} ms (goal 50 ms)"
    )


def stats_cost(rounds: int) -> None:
    """Traced steps with statistics ("stats"), without ("plain"), and untraced ("untraced"), in rotated blocks."""
    from probe.training.trace import Tracer

    print("4. traced step with output statistics vs without (and vs untraced), forward + backward + optimizer + flush")
    for name, make, block in (("launch-bound 48x16", launch_bound, 4), ("compute-bound 1024x2048", compute_bound, 3)):
        model, data = make()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        train(model, opt, data, 5)
        tracers = {
            "stats": Tracer(torch, every=1, capacity=100_000, stats=True),
            "plain": Tracer(torch, every=1, capacity=100_000, stats=False),
            "untraced": None,
        }
        times: dict = {k: [] for k in tracers}
        order = list(tracers)
        step = 0
        for r in range(6 * rounds):
            for arm in order[r % 3 :] + order[: r % 3]:
                tr = tracers[arm]
                for i in range(block):
                    step += 1
                    t0 = time.perf_counter()
                    if tr is not None:
                        tr.prepare(step)
                    train(model, opt, data, 1)
                    if tr is not None:
                        tr.finish(step, 0.0)
                    if i:  # the first step of a block pays for installing the hooks
                        times[arm].append(time.perf_counter() - t0)
                if tr is not None:
                    tr.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        calls = sum(1 for _ in model.modules())
        print(f"   {name}: {len(times['stats'])} steps per arm, {calls} module calls a step")
        print(
            f"      traced with stats {med['stats'] * 1e3:7.3f} ms   without {med['plain'] * 1e3:7.3f} ms   "
            f"untraced {med['untraced'] * 1e3:7.3f} ms"
        )
        print(
            f"      stats / plain traced step {med['stats'] / med['plain']:5.3f}x   "
            f"({(med['stats'] - med['plain']) / calls * 1e6:5.1f} us per module call)   "
            f"plain traced / untraced {med['plain'] / med['untraced']:5.3f}x"
        )


def stats_rules() -> None:
    import numpy as np

    from probe.cli.doctor import get_rule
    from probe.tables.registry import all_tables
    from probe.sql.engine import execute

    print("5. doctor rules over the output statistics, full 100k-row python.torch_trace (500 calls a step), DuckDB")
    n, calls = 100_000, 500
    rng = np.random.default_rng(0)
    seq = np.arange(n) % calls
    types = np.array(["Linear", "ReLU", "LayerNorm", "GELU", "Dropout"], dtype=object)
    names = np.array([f"blocks.{i // 5}.{i % 5}" for i in range(calls)], dtype=object)
    batch_std = rng.random(n)
    batch_std[seq % 7 == 0] = 0.0  # many outputs constant across the batch: the join's worst case
    cols = {
        "step": (np.arange(n) // calls).astype("i8"),
        "seq": seq,
        "module": names[seq],
        "stage": np.full(n, "forward", dtype=object),
        "duration": rng.random(n) * 1e-4,
        "allocated": np.full(n, 1e9),
        "max_allocated": np.full(n, 1e9),
        "time": time.time() + np.arange(n) * 1e-5,
        "rank": np.full(n, None, dtype=object),
        "depth": 1 + (seq % 3),
        "model": np.full(n, "model", dtype=object),
        "module_type": types[seq % 5],
        "out_mean": rng.random(n),
        "out_std": rng.random(n) + 0.5,
        "out_batch_std": batch_std,
        "out_zero_frac": rng.random(n),
        "out_nonfinite": np.zeros(n),
        "out_elements": np.full(n, 4096.0),
        "out_shape": np.full(n, "[64, 64]", dtype=object),
    }
    table = next(t for t in all_tables() if t.name == "python.torch_trace")
    data = {"python.torch_trace": ([(c.name, c.type) for c in table.columns], cols)}
    for name in ("dead_activations", "collapsed_output"):
        sql = get_rule(name).sql
        execute(sql, data)
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            execute(sql, data)
            samples.append(time.perf_counter() - t0)
        print(f"   {name:18s} median {statistics.median(samples) * 1e3:7.1f} ms   best {min(samples) * 1e3:7.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
