"""Stacks: one process's backtrace (its server, py-spy when it cannot answer, native frames merged), and across ranks.

``backtrace_doc`` is the one way the CLI reads a target's stacks (``backtrace``, the UI,
``query --native``); ``backtrace_table`` turns such a doc into ``python.backtrace``'s
columns; the rest summarises stacks across ranks: the main thread's top frame, and
identical stacks merged into groups.
"""

from __future__ import annotations

import os
import time

from probe._errors import ProbeError
from probe.util.usercode import is_user_file

__all__ = [
    "backtrace_doc",
    "backtrace_table",
    "main_thread",
    "top_frame",
    "user_frame",
    "stack_key",
    "group_stacks",
    "group_text",
]


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

    from .native_frames import merge_native

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
