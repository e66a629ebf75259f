"""The alternation every step-cost benchmark shares: blocks of steps rotating through the arms ``on`` (the probe's
hooks running), ``off`` (paused) and ``off2`` (paused again: the A/A arm, the run's own noise), their kept step
times in wall-clock and the training thread's CPU time, and the report of their ratios (``Alternation``); and the
probe's time at its entry points inside a plain step (``Edges``). Used by bench_budget.py, bench_torch.py and
bench_gpu.py."""

from __future__ import annotations

import statistics
import time

ARMS = ("on", "off", "off2")


class Edges:
    """The probe's time inside a plain step, at its entry points: timestamps on both sides of each.

    Timing hooks that run in every arm: a global optimizer pre-hook registered before the probe's (the probe's
    are put back at the end of torch's hook dicts at each resume) and the optimizer's own pre- and post-hooks,
    which torch runs after every global pre-hook and before every global post-hook; ``torch.autograd``'s engine
    call, timed on both sides. Per step (``note``): the optimizer step's pre-hooks, its post-hooks and its
    return, the backward call up to autograd's engine and back from it, and the whole forward call (the root
    model's forward pre-hook puts it on torch's slower module call path). The per-step medians of the "on"
    and "off" blocks are compared round by round, like the step times: these intervals are microseconds wide
    and barely move with the machine's load, so they resolve what the step-time ratio cannot. What they leave
    out: the caches the probe's work evicts, which the step's own work pays for later."""

    PARTS = ("optimizer pre-hooks", "post-hooks", "backward in", "backward out", "forward call")

    def __init__(self):
        import torch.autograd as autograd
        import torch.optim.optimizer as topt

        self.marks = {}
        self.last = None
        ns = time.perf_counter_ns
        marks = self.marks
        topt.register_optimizer_step_pre_hook(lambda o, a, k: marks.__setitem__("pre", ns()))
        engine = getattr(autograd, "_engine_run_backward", None)  # torch's own name: a global of torch.autograd
        if engine is not None:

            def timed(*args, **kwargs):
                marks["engine_in"] = ns()
                try:
                    return engine(*args, **kwargs)
                finally:
                    marks["engine_out"] = ns()

            autograd._engine_run_backward = timed

    def watch(self, opt) -> None:
        ns, marks = time.perf_counter_ns, self.marks
        opt.register_step_pre_hook(lambda o, a, k: marks.__setitem__("pre_end", ns()))
        opt.register_step_post_hook(lambda o, a, k: marks.__setitem__("post", ns()))

    def note(self, t0, t1, t2, t3, t4) -> None:
        m = self.marks
        if "engine_in" not in m:
            m["engine_in"] = m["engine_out"] = t2
        self.last = (m["pre_end"] - m["pre"], t4 - m["post"], m["engine_in"] - t2, t3 - m["engine_out"], t1 - t0)


class Alternation:
    """Blocks of ``block`` steps rotating through ARMS over ``rounds`` rounds; ``tick()`` at every step's end.

    The same schedule drives a loop we write (``run``) and a framework's loop (its
    step-end callback calls ``tick``). ``times[arm][round]`` are the kept step times.
    """

    def __init__(self, block: int, rounds: int, edges: Edges | None = None):
        from probe.training import hooks
        from probe.training.steprows import snapshot

        self.hooks = hooks
        self.snapshot = snapshot
        self.block = block
        self.plan = [(r, arm) for r in range(rounds) for arm in ARMS[r % 3 :] + ARMS[: r % 3]]
        self.times = {arm: [[] for _ in range(rounds)] for arm in ARMS}
        self.cpu = {arm: [[] for _ in range(rounds)] for arm in ARMS}  # the training thread's CPU time per step
        self.edges = edges
        self.edge = {arm: [[] for _ in range(rounds)] for arm in ARMS}  # Edges.last of each kept step
        self.i = self.n = 0
        self.last = self.last_cpu = None

    def _switch(self) -> None:
        (self.hooks.resume if self.plan[self.i][1] == "on" else self.hooks.pause)()
        self.n = 0
        self.last, self.last_cpu = time.perf_counter(), time.thread_time()

    def start(self) -> None:
        self.i = 0
        self.first_step = self.hooks.tracker().step  # this workload's rows come after
        self._switch()

    def tick(self) -> bool:
        """A step ended: keep its time; False once every block has run (the hooks are left running)."""
        now, cpu = time.perf_counter(), time.thread_time()
        r, arm = self.plan[self.i]
        if self.n:  # the block's first step pays for the switch
            self.times[arm][r].append(now - self.last)
            self.cpu[arm][r].append(cpu - self.last_cpu)
            if self.edges is not None:
                self.edge[arm][r].append(self.edges.last)
        self.n += 1
        self.last, self.last_cpu = now, cpu
        if self.n > self.block:
            self.i += 1
            if self.i == len(self.plan):
                self.hooks.resume()
                return False
            self._switch()
        return True

    def run(self, step) -> None:
        self.start()
        while True:
            step()
            if not self.tick():
                return

    def report(self, name: str) -> None:
        import numpy as np

        med = {arm: [statistics.median(t) for t in self.times[arm] if t] for arm in ARMS}
        ratios = {k: sorted(a / b for a, b in zip(med[k], med["off"])) for k in ("on", "off2")}
        cmed = {arm: [statistics.median(t) for t in self.cpu[arm] if t] for arm in ARMS}
        cratios = {k: sorted(a / b for a, b in zip(cmed[k], cmed["off"])) for k in ("on", "off2")}
        step = statistics.median(med["off"])
        cols = self.snapshot(self.hooks.tracker())
        keep = cols["step"] > self.first_step
        us, measured = cols["probe_us"][keep], cols["measured"][keep]
        # the steps the hooks saw (the "on" blocks): how many carry the core signals
        loss, memory = (
            np.ma.getmaskarray(np.ma.asarray(cols["loss"])[keep]),
            np.ma.getmaskarray(np.ma.asarray(cols["memory"])[keep]),
        )
        on_step = statistics.fmean(t for block in self.times["on"] for t in block)
        n = sum(len(t) for t in self.times["on"])
        print(
            f"  {name:<22} step {step * 1e3:7.2f} ms  {n:5d} steps/arm\n"
            f"    wall: on/off {_fmt(ratios['on'])}  off2/off {_fmt(ratios['off2'])}\n"
            f"    cpu:  on/off {_fmt(cratios['on'])}  off2/off {_fmt(cratios['off2'])}\n"
            f"    probe_us per step: mean {us.mean():6.1f} = {100 * us.mean() * 1e-6 / on_step:5.2f} % of the step"
            f" (median {np.median(us):5.1f}; unmeasured steps {_median(us[~measured])}, measured "
            f"{_median(us[measured])});"
            f" measured {100 * measured.mean():5.1f} % of steps\n"
            f"    core signals on the probed steps: loss {100 * (1 - loss.mean()):5.1f} %, memory "
            f"{100 * (1 - memory.mean()):5.1f} %"
        )
        if self.edges is not None:
            self._report_edges(step)

    def _report_edges(self, step: float) -> None:
        """The probe's time at its entry points in the step (``Edges``): on minus off, per part."""
        parts, total = [], 0.0
        for i, part in enumerate(Edges.PARTS):
            diffs = sorted(
                (statistics.median(e[i] for e in on) - statistics.median(e[i] for e in off)) * 1e-3
                for on, off in zip(self.edge["on"], self.edge["off"])
                if on and off
            )
            lo, med, hi = _quartiles(diffs)
            if i < len(Edges.PARTS) - 1:
                total += med
            parts.append(f"{part} {med:+.2f} [{lo:+.2f} {hi:+.2f}]")
        print(
            f"    in the step, on-off at the probe's entry points (us, median [25th-75th]): {', '.join(parts[:-1])};"
            f" sum {total:.2f} us = {100 * total * 1e-6 / step:.2f} % of the step; {parts[-1]}"
        )


def _median(values) -> str:
    import numpy as np

    return f"{np.median(values):5.1f}" if len(values) else "  n/a"


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile) of ``values``."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def _fmt(ratios: list[float]) -> str:
    lo, med, hi = _quartiles(ratios)
    return f"{med:.3f} [{lo:.3f}-{hi:.3f}]"
