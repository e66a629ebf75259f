"""Writing a traced step: naming its modules, and turning its raw records into ``python.torch_trace`` columns.

The tracer's hooks append bare tuples during the step (the module object, perf_counter times,
memory, depth, CUDA events); at the boundary after it, ``step_records`` names each call's module
(its dotted path in the model found by the object finder, and that model's name) and puts the
forward, backward and recomputation calls in time order, and ``columns`` lays them out as the
ring's numpy columns, once per traced step. Values read from the device later (CUDA durations,
output statistics) are written into the ring once they have landed (``landed_*``).
"""

from __future__ import annotations

import weakref

from . import finder
from ..util.errorlog import record_error

__all__ = ["ModuleNames", "step_records", "columns"]


class ModuleNames:
    """``name_of(module)``: ``(dotted path, model name)`` of a module of a found model, else its class
    name and ''. Kept by object id with a weakref check, so a module that is gone is never named."""

    def __init__(self):
        self._names: dict = {}

    def name_of(self, module) -> tuple[str, str]:
        key = id(module)
        hit = self._names.get(key)
        if hit is not None and hit[0]() is module:
            return hit[1], hit[2]
        for root_name, root, _, _ in finder.known("model"):
            if root is module:
                self._names[key] = (weakref.ref(module), root_name, root_name)
                return root_name, root_name
            for name, sub in root.named_modules():
                try:
                    self._names[id(sub)] = (weakref.ref(sub), finder.module_path(name) or root_name, root_name)
                except TypeError:
                    pass
            hit = self._names.get(key)
            if hit is not None and hit[0]() is module:
                return hit[1], hit[2]
        name = type(module).__name__
        try:
            self._names[key] = (weakref.ref(module), name, "")
        except TypeError:
            pass
        return name, ""


def step_records(rows, out, back, again, name_of) -> list:
    """One traced step's calls in time order: ``(t0, module, model, cls, stage, t1, mem, depth, ev0, ev1,
    output statistics)``, from the forward ``rows`` (with their statistics ``out``), the backward cuts
    ``back`` and the recomputations ``again`` (which take the depth their module had in the forward)."""
    records = []
    for r, st in zip(rows, out):  # (module, t0, t1, mem, depth) on CPU, plus (ev0, ev1) on CUDA
        m = r[0]
        name, model = name_of(m)
        evs = r[5:] if len(r) > 5 else (None, None)
        records.append((r[1], name, model, type(m).__name__, "forward", r[2], r[3], r[4], *evs, st))
    for m, t0, t1, memv, ev0, ev1 in back:
        name, model = name_of(m)
        records.append((t0, name, model, type(m).__name__, "backward", t1, memv, 0, ev0, ev1, None))
    if again:
        depth_of = {}
        for r in rows:
            depth_of.setdefault(id(r[0]), r[4])
        for r in again:  # (module, t0, t1, mem) on CPU, plus (ev0, ev1) on CUDA
            m = r[0]
            name, model = name_of(m)
            evs = r[4:] if len(r) > 4 else (None, None)
            records.append(
                (
                    r[1],
                    name,
                    model,
                    type(m).__name__,
                    "recompute",
                    r[2],
                    r[3],
                    depth_of.get(id(m), name.count(".") + 1 if model else 0),
                    *evs,
                    None,
                )
            )
    records.sort(key=lambda r: r[0])
    return records


def columns(records: list, step: int, wall_offset: float, rank, cuda: bool = False) -> dict:
    """The ring's columns of ``records`` (output statistics aside); on CUDA the durations are device time,
    NULL until their events complete (``landed_durations``)."""
    import numpy as np

    n = len(records)
    t0 = np.fromiter((r[0] for r in records), "f8", n)
    t1 = np.fromiter((r[5] for r in records), "f8", n)
    memv = np.fromiter((r[6] for r in records), "f8", n)
    peak = np.fmax.accumulate(memv) if n else memv
    cols = {
        "step": np.full(n, step, "i8"),
        "seq": np.arange(n, dtype="i8"),
        "module": np.array([r[1] for r in records], dtype=object),
        "stage": np.array([r[4] for r in records], dtype=object),
        "duration": t1 - t0,
        "allocated": memv,
        "max_allocated": peak,
        "time": t0 + wall_offset,
        "rank": np.full(n, np.nan if rank is None else rank, "f8"),
        "depth": np.fromiter((r[7] for r in records), "i8", n),
        "model": np.array([r[2] for r in records], dtype=object),
        "module_type": np.array([r[3] for r in records], dtype=object),
    }
    if cuda:
        cols["duration"] = np.ma.masked_all(n)
    return cols


def landed_durations(ring, pending: list, pool: list) -> list:
    """Write the CUDA durations of ``pending`` (``(row, start event, end event)``) whose events have
    completed into ``ring``; returns those still waiting. Events done with go back to ``pool``."""
    keep = []
    dur, known = ring.arrays["duration"], ring.valid["duration"]
    for row, ev0, ev1 in pending:
        if ring.count - row > ring.capacity:
            pool.extend((ev0, ev1))
            continue
        try:
            done = ev1.query()
        except Exception as exc:
            record_error("torch trace: cuda event", exc)
            continue
        if done:
            dur[row % ring.capacity] = ev0.elapsed_time(ev1) / 1000.0
            known[row % ring.capacity] = True
            pool.extend((ev0, ev1))
        else:
            keep.append((row, ev0, ev1))
    return keep


def landed_stats(ring, pending: list) -> list:
    """Write the output statistics of ``pending`` (``outstats.Batch``) whose device copies have landed into
    ``ring``; returns those still waiting (a batch whose rows the ring has overwritten is dropped)."""
    keep = []
    for batch in pending:
        try:
            if batch.stale(ring.count, ring.capacity) or batch.write(ring):
                continue
        except Exception as exc:
            record_error("torch trace: output statistics", exc)
            continue
        keep.append(batch)
    return keep
