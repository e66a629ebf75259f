"""Chrome trace-event JSON from probe's tables: the timeline Perfetto and chrome://tracing open.

docs/timeline.md lists the tracks (one process per rank, one thread track per stage, span
thread and process group) and where each comes from. Every slice is a complete event
(``ph: X``); collectives whose end the backend does not report are instant events (``ph: i``).

``rank_rows`` asks one process for those rows (its last steps, module trace, spans and
collectives, through the query runner); ``build_trace`` is a pure function of the rows, so
it needs no client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from probe._errors import ProbeError


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
    for order, rr in enumerate(
        sorted(ranks, key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0, r.pid or 0))
    ):
        pid = rr.rank if rr.rank is not None else (rr.pid or order)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": rr.label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": order}})
        tids: dict[str, int] = {}

        def tid(name: str, number: int, tids: dict = tids, pid: int = pid) -> int:  # this rank's, used below
            if name not in tids:
                tids[name] = number
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": number, "args": {"name": name}})
                events.append(
                    {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": number, "args": {"sort_index": number}}
                )
            return tids[name]

        def add(name: str, cat: str, track: tuple, row: dict, args: dict, pid: int = pid, tid=tid) -> None:
            """A complete slice on ``track`` (its name and number) from ``row``'s start and duration; none while
            either is unknown (a CUDA duration not resolved yet)."""
            start, dur = _num(row["start"]), _num(row["duration"])
            if start is None or dur is None:
                return
            events.append(
                {
                    "ph": "X",
                    "name": name,
                    "cat": cat,
                    "pid": pid,
                    "tid": tid(*track),
                    "ts": us(start),
                    "dur": round(dur * 1e6, 3),
                    "args": _args(args),
                }
            )

        for s in rr.steps:
            args = {"step": s["step"], "loss": _num(s.get("loss")), "lr": _num(s.get("lr"))}
            add(f"step {s['step']}", "step", ("steps", TRACKS["steps"]), s, args)
        for m in rr.modules:
            stage = m["stage"] if m["stage"] in TRACKS else "forward"
            args = {
                "step": m["step"],
                "depth": m.get("depth"),
                "type": m.get("module_type"),
                "model": m.get("model") or None,
            }
            add(m["module"], f"module,{stage}", (stage, TRACKS[stage]), m, args)
        threads = sorted(
            {(str(s.get("thread") or "?"), s.get("thread_id") or 0) for s in rr.spans},
            key=lambda t: (t[0] != "MainThread", t[0], t[1]),
        )
        span_tracks = {}
        for i, (name, ident) in enumerate(threads):
            label = f"spans: {name}" + (f" ({ident})" if sum(1 for n, _ in threads if n == name) > 1 else "")
            span_tracks[(name, ident)] = (label, tid(label, _SPAN_TID0 + i))
        for s in rr.spans:
            track = span_tracks[(str(s.get("thread") or "?"), s.get("thread_id") or 0)]
            add(
                s["name"], "span", track, s, {"step": s.get("step"), "depth": s.get("depth"), "parent": s.get("parent")}
            )
        groups = sorted({str(c.get("pg") or "0") for c in rr.collectives})
        for c in rr.collectives:
            start = _num(c["start"])
            if start is None:
                continue
            g = str(c.get("pg") or "0")
            t = tid(f"collectives: {g}", _COLL_TID0 + groups.index(g))
            end = _num(c.get("end"))
            ev = {
                "name": str(c.get("op") or "collective"),
                "cat": "collective",
                "pid": pid,
                "tid": t,
                "ts": us(start),
                "args": _args(
                    {"seq": c.get("seq"), "state": c.get("state"), "step": c.get("step"), "sizes": c.get("sizes")}
                ),
            }
            if end is not None and end >= start:
                ev.update(ph="X", dur=round((end - start) * 1e6, 3))
            else:
                ev.update(ph="i", s="t")
            events.append(ev)
    # Metadata first, then slices by time with longer (enclosing) slices first at equal starts.
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0), -e.get("dur", 0)))
    _snap(events)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "probe", "epoch_origin_s": t0, **(meta or {})},
    }


def _rows(session, target, sql: str) -> list[dict]:
    """One read-only query on one process, its rows as dicts; the one place this module asks for rows.

    Federation with one process: its snapshots, DuckDB here in the client.
    """
    from .query_runner import federated_query

    result = federated_query(session, sql, targets=[target])
    return [dict(zip(result.columns, r)) for r in result.rows]


_STEPS = "SELECT step, epoch(started_at) AS start, duration, loss, lr FROM torch.steps WHERE step {} ORDER BY step"
_MODULES = (
    "SELECT step, epoch(time) AS start, duration, module, stage, depth, module_type, model "
    "FROM python.torch_trace WHERE step {} ORDER BY time"
)


def rank_rows(session, target, steps: int) -> tuple[RankRows, list[str]]:
    """The last ``steps`` steps of one process, with their module trace, spans and collectives."""
    tables = {t["name"] for t in session.client(target).get("/tables")["tables"]}
    last = _rows(session, target, "SELECT MAX(step) AS s FROM torch.steps")[0]["s"]
    rank = target.rank if target.rank is not None else target.entry.get("rank")
    label = (
        " · ".join(
            x for x in (f"rank {rank}" if rank is not None else None, f"pid {target.pid}" if target.pid else None) if x
        )
        or target.label
    )
    rr = RankRows(rank=rank, pid=target.pid, label=label)
    notes = []
    if last is None:
        notes.append(f"{target.label}: no training step recorded yet (torch.steps is empty)")
        window = "> 0"
    else:  # the last `steps` completed steps, fixed now: training goes on while we ask
        window = f"BETWEEN {int(last) - steps + 1} AND {int(last)}"
        rr.steps = _rows(session, target, _STEPS.format(window))
    rr.modules = _rows(session, target, _MODULES.format(window))
    if not rr.modules and last is not None:
        latest = _rows(session, target, "SELECT MAX(step) AS s FROM python.torch_trace")[0]["s"]
        if latest is not None:
            rr.modules = _rows(session, target, _MODULES.format(f"= {int(latest)}"))
            rr.steps += _rows(session, target, _STEPS.format(f"= {int(latest)}"))
            notes.append(
                f"{target.label}: none of the last {steps} steps was traced (PROBE_TRACE samples steps); "
                f"included step {int(latest)}, the latest traced one"
            )
        else:
            notes.append(f"{target.label}: no module trace recorded (PROBE_TRACE=off?)")
    if "python.spans" in tables:
        rr.spans = _rows(
            session,
            target,
            "SELECT name, step, epoch(time) AS start, duration, depth, parent, thread, thread_id FROM python.spans "
            f"WHERE step {window} ORDER BY time",
        )
    if "torch.collectives" in tables:
        try:
            rr.collectives = _rows(
                session,
                target,
                "SELECT pg_desc AS pg, op, seq, state, epoch(COALESCE(started_at, created_at)) AS start, "
                'epoch(completed_at) AS "end", step, input_sizes AS sizes FROM torch.collectives '
                f"WHERE step {window} ORDER BY created_at",
            )
        except ProbeError as exc:  # a recorder table of another shape: the timeline goes on without it
            notes.append(f"{target.label}: collectives left out ({exc.message.rstrip('.')})")
    return rr, notes
