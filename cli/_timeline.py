"""Chrome trace-event JSON from probe's tables: the timeline Perfetto and chrome://tracing open.

One process track per rank (``pid`` is the rank; the OS pid when the job has no
ranks), and within it one thread track per stage: ``steps`` (step boundaries),
``forward`` and ``backward`` (the sampled module trace, nested by call), one track per
Python thread that recorded user spans (``spans: MainThread``), and one per process
group for collectives. Every slice is a complete event (``ph: X``) with ``ts`` and
``dur`` in microseconds from the earliest event of the file; collectives whose end the
backend does not report are instant events (``ph: i``).

The input is plain rows (dicts) per rank, so this module needs no client and is a
pure function of what the queries returned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["RankRows", "build_trace"]

TRACKS = {"steps": 1, "forward": 2, "backward": 3, "recompute": 4}  # recompute: activation checkpointing
_SPAN_TID0 = 10
_COLL_TID0 = 100


@dataclass
class RankRows:
    """What one rank's queries returned; times are epoch seconds (float)."""

    rank: int | None
    pid: int | None
    label: str
    steps: list = field(default_factory=list)  # step, start, duration, loss, lr
    modules: list = field(default_factory=list)  # step, start, duration, module, stage, depth, module_type, model
    spans: list = field(default_factory=list)  # name, step, start, duration, depth, parent, thread, thread_id
    collectives: list = field(default_factory=list)  # pg, op, seq, state, start, end, step, sizes


def _num(v) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _args(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None and not (isinstance(v, float) and not math.isfinite(v))}


SNAP_US = 2.0  # table timestamps have 1 µs resolution; durations are exact floats


def _snap(events: list[dict]) -> None:
    """Make slices on one track nest: a slice that overshoots the next one's start or its
    parent's end by less than the timestamps' resolution is clipped there (in place).

    ``events`` are sorted by start, enclosing slices first. Without this, a step that
    ends where the next begins can overlap it by a fraction of a microsecond, and the
    viewers then draw the next step as its child.
    """
    stacks: dict = {}
    for e in events:
        if e["ph"] != "X":
            continue
        stack = stacks.setdefault((e["pid"], e["tid"]), [])
        while stack:
            top = stack[-1]
            end = top["ts"] + top["dur"]
            if e["ts"] >= end:
                stack.pop()
            elif e["ts"] >= end - SNAP_US and e["ts"] + e["dur"] > end:
                top["dur"] = round(e["ts"] - top["ts"], 3)  # a sibling that starts where this one ends
                stack.pop()
            else:
                break
        if stack:
            end = stack[-1]["ts"] + stack[-1]["dur"]
            if end < e["ts"] + e["dur"] <= end + SNAP_US:
                e["dur"] = round(end - e["ts"], 3)  # a child that ends where its parent does
        stack.append(e)


def build_trace(ranks: list[RankRows], meta: dict | None = None) -> dict:
    """The trace-event document (JSON object format) for these ranks."""
    starts = [_num(r["start"]) for rr in ranks for part in (rr.steps, rr.modules, rr.spans) for r in part]
    starts += [_num(c["start"]) for rr in ranks for c in rr.collectives]
    starts = [s for s in starts if s is not None]
    t0 = min(starts) if starts else 0.0

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    events: list[dict] = []
    for order, rr in enumerate(sorted(ranks, key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0, r.pid or 0))):
        pid = rr.rank if rr.rank is not None else (rr.pid or order)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": rr.label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": order}})
        tids: dict[str, int] = {}

        def tid(name: str, number: int) -> int:
            if name not in tids:
                tids[name] = number
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": number, "args": {"name": name}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": number, "args": {"sort_index": number}})
            return tids[name]

        for s in rr.steps:
            start, dur = _num(s["start"]), _num(s["duration"])
            if start is None or dur is None:
                continue
            events.append({"ph": "X", "name": f"step {s['step']}", "cat": "step", "pid": pid, "tid": tid("steps", TRACKS["steps"]),
                           "ts": us(start), "dur": round(dur * 1e6, 3),
                           "args": _args({"step": s["step"], "loss": _num(s.get("loss")), "lr": _num(s.get("lr"))})})
        for m in rr.modules:
            start, dur = _num(m["start"]), _num(m["duration"])
            if start is None or dur is None:
                continue  # a CUDA duration not resolved yet
            stage = m["stage"] if m["stage"] in TRACKS else "forward"
            events.append({"ph": "X", "name": m["module"], "cat": f"module,{stage}", "pid": pid,
                           "tid": tid(stage, TRACKS[stage]), "ts": us(start), "dur": round(dur * 1e6, 3),
                           "args": _args({"step": m["step"], "depth": m.get("depth"), "type": m.get("module_type"),
                                          "model": m.get("model") or None})})
        threads = sorted({(str(s.get("thread") or "?"), s.get("thread_id") or 0) for s in rr.spans},
                         key=lambda t: (t[0] != "MainThread", t[0], t[1]))
        for i, (name, ident) in enumerate(threads):
            tid(f"spans: {name}" + (f" ({ident})" if sum(1 for n, _ in threads if n == name) > 1 else ""), _SPAN_TID0 + i)
        span_tid = {key: _SPAN_TID0 + i for i, key in enumerate(threads)}
        for s in rr.spans:
            start, dur = _num(s["start"]), _num(s["duration"])
            if start is None or dur is None:
                continue
            events.append({"ph": "X", "name": s["name"], "cat": "span", "pid": pid,
                           "tid": span_tid[(str(s.get("thread") or "?"), s.get("thread_id") or 0)],
                           "ts": us(start), "dur": round(dur * 1e6, 3),
                           "args": _args({"step": s.get("step"), "depth": s.get("depth"), "parent": s.get("parent")})})
        groups = sorted({str(c.get("pg") or "0") for c in rr.collectives})
        for c in rr.collectives:
            start = _num(c["start"])
            if start is None:
                continue
            g = str(c.get("pg") or "0")
            t = tid(f"collectives: {g}", _COLL_TID0 + groups.index(g))
            end = _num(c.get("end"))
            ev = {"name": str(c.get("op") or "collective"), "cat": "collective", "pid": pid, "tid": t, "ts": us(start),
                  "args": _args({"seq": c.get("seq"), "state": c.get("state"), "step": c.get("step"), "sizes": c.get("sizes")})}
            if end is not None and end >= start:
                ev.update(ph="X", dur=round((end - start) * 1e6, 3))
            else:
                ev.update(ph="i", s="t")
            events.append(ev)
    # Metadata first, then slices by time with longer (enclosing) slices first at equal starts.
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0), -e.get("dur", 0)))
    _snap(events)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "probe", "epoch_origin_s": t0, **(meta or {})}}
