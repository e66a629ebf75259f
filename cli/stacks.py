"""Stacks: one process's backtrace (its server, py-spy when it cannot answer, native frames merged), across
ranks, and sampled stacks written as files.

``backtrace_doc`` is the one way the CLI reads a target's stacks (``backtrace``, the UI,
``query --native``); ``backtrace_table`` turns such a doc into ``python.backtrace``'s
columns; the rest summarises stacks across ranks: the main thread's top frame, and
identical stacks merged into groups.

Native frames (``merge_native``): the probe's server sees only Python frames (with locals, thread names and
daemon flags); py-spy ``--native`` sees C/C++ frames too, interleaved with the Python ones. The two are read a
moment apart, so a running thread may have moved: the merge walks each thread's Python frames from the
outermost in and takes the probe's frame (richer) while the two agree on function and file; from the first
disagreement inwards it keeps py-spy's frames, which are consistent with its native ones. Threads only one
side saw are kept as that side reported them.

Sampled stacks as files (``to_collapsed``, ``to_speedscope``, ``to_svg``: ``probe PID profile -o FILE``):
collapsed text, speedscope JSON, or a self-contained SVG flamegraph, from ``[["root;child;leaf", count], ...]``
(root first), as ``GET /profile`` answers and as ``py-spy record --format raw`` writes them. The page draws
the same data in JavaScript.
"""

from __future__ import annotations

import html
import json
import os
import time

from probe._errors import ProbeError
from probe.util.printable import stack_text
from probe.util.usercode import is_user_file


def main_thread(doc: dict, thread: str | None = None) -> dict | None:
    """The main thread of a backtrace doc (or the first thread when ``thread`` picked one)."""
    threads = doc.get("threads") or []
    if thread:
        return threads[0] if threads else None
    return next((t for t in threads if t.get("is_main")), threads[0] if threads else None)


def _where(frame: dict) -> str:
    return f"{frame.get('func')} ({os.path.basename(str(frame.get('file')))}:{frame.get('lineno')})"


def top_frame(doc: dict) -> str | None:
    """``func (file.py:line)`` of the innermost frame of the main thread.

    >>> top_frame({"threads": [{"is_main": True, "frames": [{"func": "wait", "file": "/x/c10d.py", "lineno": 9}]}]})
    'wait (c10d.py:9)'
    """
    t = main_thread(doc)
    frames = (t or {}).get("frames") or []
    return _where(frames[0]) if frames else None


def user_frame(frames: list) -> dict | None:
    """The innermost frame of the user's code (``probe.util.usercode``: not the standard library, probe, torch
    or a training framework)."""
    return next((f for f in frames if is_user_file(str(f.get("file")))), None)


def stack_key(frames: list) -> tuple:
    """Identity of a stack: its (func, file, line) triples."""
    return tuple((f.get("func"), f.get("file"), f.get("lineno")) for f in frames)


def _summary(frames: list) -> str:
    if not frames:
        return "no Python frames"
    text = f"in {_where(frames[0])}"
    user = user_frame(frames)
    if user is not None and user is not frames[0]:
        text += f", from {_where(user)}"
    return text


def group_stacks(answers: list, thread: str | None = None) -> list:
    """Identical main-thread stacks merged: ``[(ranks, label, summary, frames)]``, largest group first.

    ``answers`` are fan-out answers whose value is a backtrace doc; unreachable ones are left out.
    """
    from .plumbing.fanout import format_ranks

    groups: dict[tuple, list] = {}
    frames_of: dict[tuple, list] = {}
    for a in answers:
        if not a.ok:
            continue
        t = main_thread(a.value, thread)
        frames = (t or {}).get("frames") or []
        key = stack_key(frames)
        groups.setdefault(key, []).append(a.rank if a.rank is not None else a.target.pid)
        frames_of[key] = frames
    return [
        (ranks, format_ranks(ranks), _summary(frames_of[key]), frames_of[key])
        for key, ranks in sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    ]


def group_text(answers: list, thread: str | None = None) -> str:
    """One block per distinct stack, largest group first; the odd rank out stands alone.

    ``answers`` are fan-out answers whose value is a backtrace doc.
    """
    from .render import frame_line

    which = f"thread {thread}" if thread else "main thread"
    lines = [f"Stacks of the {which} across {len(answers)} ranks, identical stacks merged (innermost frame first):"]
    for _ranks, label, summary, frames in group_stacks(answers, thread):
        lines.append("")
        lines.append(f"{label}: {summary}")
        lines.extend(frame_line(f, show_line=False) for f in frames)
    for a in answers:
        if not a.ok:
            lines.append("")
            lines.append(f"{a.target.label}: unreachable: {a.error}")
    return "\n".join(lines)


SERVER_BACKTRACE_TIMEOUT = 3.0  # a local server that stays silent this long is presumed stuck; py-spy takes over


def _paced(wait: float) -> dict:
    """How long the server may keep a backtrace waiting for its share (``PROBE_SERVE_SHARE``): half of what the
    client waits, so that a paced request is answered 503 before the client gives up on it."""
    return {"wait": f"{max(wait / 2, 0.05):g}"}


def backtrace_doc(session, target, args) -> dict:
    """The server's backtrace; for a local pid whose server is missing or silent, py-spy's (with a note saying why)."""
    from probe._errors import AuthError, QueryError

    from .plumbing.postmortem import is_postmortem

    if is_postmortem(target):  # a dead process: the stacks its post-mortem record keeps
        doc = session.client(target).get("/backtrace", thread=args.thread)
        if args.native or args.subprocesses or args.locals:
            doc["note"] += "\n[native frames, child processes and locals are not kept in a post-mortem record]"
        return doc
    local = target.local_pid
    if args.native and not args.subprocesses and local is not None and not target.entry.get("missing"):
        merged = _native_merged(session, target, args)  # a live server: its frames plus py-spy's native ones
        if merged is not None:
            return merged
    if args.native or args.subprocesses:
        reason = "native frames were asked for" if args.native else "child processes were asked for"
    else:
        wait = min(session.timeout, SERVER_BACKTRACE_TIMEOUT) if local else session.timeout
        try:
            return session.client(target).get(
                "/backtrace", timeout=wait, thread=args.thread, locals=1 if args.locals else None, **_paced(wait)
            )
        except ProbeError as exc:
            if local is None or isinstance(exc, (AuthError, QueryError)) or exc.kind == "busy":
                raise  # a busy server answered: it is alive, and py-spy would only add to its load
            if target.entry.get("missing"):
                reason = f"process {local} has no probe server"
            elif "did not answer" in exc.message:
                reason = f"its probe server did not answer within {wait:g} s (a thread may hold the GIL in a C call)"
            else:
                reason = f"its probe server could not be reached ({exc.message.rstrip('.')})"
    if local is None:
        raise ProbeError(
            "--native and --subprocesses read the process with py-spy, which works only on its host; "
            "run the command on the process's node."
        )
    from probe.injector import pyspy_backtrace

    started = time.perf_counter()
    doc = pyspy_backtrace(
        local, native=args.native, subprocesses=args.subprocesses, thread=args.thread, timeout=max(session.timeout, 5.0)
    )
    if doc.get("rank") is None:
        doc["rank"] = target.rank if target.rank is not None else target.entry.get("rank")
    extra = "; locals are not available from py-spy" if args.locals else ""
    doc["note"] = f"[stacks read by py-spy in {time.perf_counter() - started:.2f} s because {reason}{extra}]"
    return doc


def _native_merged(session, target, args) -> dict | None:
    """The server's backtrace with py-spy's native frames merged in; None when the server does not answer."""
    try:
        ours = session.client(target).get(
            "/backtrace",
            timeout=min(session.timeout, SERVER_BACKTRACE_TIMEOUT),
            thread=args.thread,
            locals=1 if args.locals else None,
            **_paced(min(session.timeout, SERVER_BACKTRACE_TIMEOUT)),
        )
    except ProbeError:
        return None  # the py-spy fallback below says why
    from probe.injector import pyspy_backtrace

    started = time.perf_counter()
    spy = pyspy_backtrace(target.local_pid, native=True, thread=args.thread, timeout=max(session.timeout, 5.0))
    doc = merge_native(ours, spy)
    m = doc["native_merge"]
    doc["note"] = (
        f"[native frames read by py-spy in {time.perf_counter() - started:.2f} s and merged with the probe's; "
        f"{m['from_probe']} of {m['python_frames']} Python frames agreed and carry the probe's details]"
    )
    return doc


BACKTRACE_COLUMNS = [
    ("thread_id", "BIGINT"),
    ("thread_name", "VARCHAR"),
    ("is_main", "BOOLEAN"),
    ("depth", "INTEGER"),
    ("func", "VARCHAR"),
    ("file", "VARCHAR"),
    ("lineno", "INTEGER"),
    ("line", "VARCHAR"),
    ("is_native", "BOOLEAN"),
]


def backtrace_table(doc: dict) -> tuple[list, dict]:
    """A backtrace doc as ``python.backtrace``'s ``([(column, type)], {column: values})``.

    The columns are the in-process table's; ``is_native`` is true for the C/C++ frames
    py-spy read (``query --native``), whose ``line`` is NULL and whose ``file`` is the
    shared library or C source py-spy named.
    """
    data: dict = {c: [] for c, _ in BACKTRACE_COLUMNS}
    for t in doc.get("threads") or []:
        for depth, f in enumerate(t.get("frames") or []):
            for col, value in (
                ("thread_id", t.get("thread_id")),
                ("thread_name", t.get("name")),
                ("is_main", bool(t.get("is_main"))),
                ("depth", depth),
                ("func", f.get("func")),
                ("file", f.get("file")),
                ("lineno", f.get("lineno")),
                ("line", None if f.get("native") else f.get("line")),
                ("is_native", bool(f.get("native"))),
            ):
                data[col].append(value)
    return list(BACKTRACE_COLUMNS), data


# -- native frames merged with the probe's ----------------------------------------------------------------------


def _same(ours: dict, spy: dict) -> bool:
    return ours.get("func") == spy.get("func") and os.path.basename(str(ours.get("file"))) == os.path.basename(
        str(spy.get("file"))
    )


def _merge_thread(ours: dict, spy: dict) -> tuple[dict, int, int]:
    """The merged thread, how many Python frames came from the probe, and how many Python frames in all."""
    spy_frames = spy.get("frames") or []
    python_at = [i for i, f in enumerate(spy_frames) if not f.get("native")]
    our_frames = ours.get("frames") or []
    taken: dict[int, dict] = {}
    for i, j in zip(reversed(python_at), range(len(our_frames) - 1, -1, -1)):
        if not _same(our_frames[j], spy_frames[i]):
            break
        taken[i] = our_frames[j]
    frames = []
    for depth, f in enumerate(spy_frames):
        f = dict(taken.get(depth) or f)
        f["depth"] = depth
        f["native"] = bool(spy_frames[depth].get("native"))
        frames.append(f)
    merged = {**spy, **{k: v for k, v in ours.items() if k != "frames" and v is not None}, "frames": frames}
    return merged, len(taken), len(python_at)


def merge_native(ours: dict, spy: dict) -> dict:
    """The probe's backtrace with py-spy's native frames merged into each thread."""
    by_native = {t.get("native_id"): t for t in spy.get("threads") or [] if t.get("native_id") is not None}
    threads, agreed, total = [], 0, 0
    seen = set()
    for t in ours.get("threads") or []:
        other = by_native.get(t.get("native_id"))
        if other is None:
            threads.append(t)
            continue
        seen.add(t.get("native_id"))
        merged, a, n = _merge_thread(t, other)
        threads.append(merged)
        agreed, total = agreed + a, total + n
    threads += [t for nid, t in by_native.items() if nid not in seen]
    doc = {**ours, "source": "probe+py-spy", "threads": threads}
    doc["native_merge"] = {"python_frames": total, "from_probe": agreed}
    return doc


# -- sampled stacks as files --------------------------------------------------------------------------------


FORMATS = ("collapsed", "speedscope", "svg")


def to_collapsed(stacks: list) -> str:
    """One ``stack count`` line per stack.

    >>> to_collapsed([["a;b", 2]])
    'a;b 2\\n'
    """
    return "".join(f"{stack_text(s)} {int(n)}\n" for s, n in stacks)


def to_speedscope(stacks: list, name: str) -> str:
    """A speedscope 'sampled' profile: one sample per distinct stack, weighted by its count."""
    frames: dict[str, int] = {}
    samples, weights = [], []
    for stack, n in stacks:
        samples.append([frames.setdefault(f, len(frames)) for f in stack.split(";")])
        weights.append(n)
    total = sum(weights)
    return json.dumps(
        {
            "$schema": "https://www.speedscope.app/file-format-schema.json",
            "name": name,
            "exporter": "probe",
            "shared": {"frames": [{"name": f} for f in frames]},
            "profiles": [
                {
                    "type": "sampled",
                    "name": name,
                    "unit": "none",
                    "startValue": 0,
                    "endValue": total,
                    "samples": samples,
                    "weights": weights,
                }
            ],
        }
    )


def _tree(stacks: list) -> dict:
    root = {"name": "all", "value": 0, "children": {}}
    for stack, n in stacks:
        node = root
        root["value"] += n
        for f in stack.split(";"):
            node = node["children"].setdefault(f, {"name": f, "value": 0, "children": {}})
            node["value"] += n
    return root


def _color(name: str) -> str:
    h = 0
    for ch in name:
        h = (h * 31 + ord(ch)) & 0xFFFF
    if name.startswith("thread ") or name.startswith("rank "):
        return "rgb(190,190,200)"
    return f"rgb({205 + h % 50},{90 + (h >> 4) % 110},{40 + (h >> 8) % 40})"


def to_svg(stacks: list, title: str, width: int = 1200, row: int = 17) -> str:
    """A static flamegraph (root at the bottom), each box titled with its samples and share."""
    root = _tree(stacks)
    total = root["value"] or 1
    boxes = []
    depth_max = 0

    def walk(node, x, depth):
        nonlocal depth_max
        depth_max = max(depth_max, depth)
        boxes.append((node, x, depth))
        for child in sorted(node["children"].values(), key=lambda c: c["name"]):
            walk(child, x, depth + 1)
            x += child["value"]

    walk(root, 0, 0)
    height = (depth_max + 1) * row + 40
    scale = (width - 20) / total
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="monospace" font-size="11">',
        f'<text x="10" y="18" font-size="14">{html.escape(title)}</text>',
    ]
    for node, x, depth in boxes:
        w = node["value"] * scale
        if w < 0.5:
            continue
        y = height - (depth + 1) * row
        share = 100.0 * node["value"] / total
        label = html.escape(node["name"])
        out.append(
            f"<g><title>{label} ({node['value']} samples, {share:.1f}%)</title>"
            f'<rect x="{10 + x * scale:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" '
            f'fill="{_color(node["name"])}" rx="2"/>'
        )
        chars = int(w / 7)
        if chars >= 3:
            text = node["name"] if len(node["name"]) <= chars else node["name"][: chars - 2] + ".."
            out.append(f'<text x="{12 + x * scale:.1f}" y="{y + row - 5}">{html.escape(text)}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"
