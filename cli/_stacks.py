"""Stacks across ranks: the main thread's top frame, and identical stacks merged into groups."""

from __future__ import annotations

import os

__all__ = ["main_thread", "top_frame", "user_frame", "stack_key", "group_stacks", "group_text"]

_LIBRARY_MARKERS = ("site-packages", "dist-packages", "/lib/python", "<frozen")


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
    """The innermost frame outside the standard library and installed packages."""
    return next((f for f in frames if not any(m in str(f.get("file")) for m in _LIBRARY_MARKERS)), None)


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
    from ._fanout import format_ranks

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
    return [(ranks, format_ranks(ranks), _summary(frames_of[key]), frames_of[key])
            for key, ranks in sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))]


def group_text(answers: list, thread: str | None = None) -> str:
    """One block per distinct stack, largest group first; the odd rank out stands alone.

    ``answers`` are fan-out answers whose value is a backtrace doc.
    """
    which = f"thread {thread}" if thread else "main thread"
    lines = [f"Stacks of the {which} across {len(answers)} ranks, identical stacks merged (innermost frame first):"]
    for _ranks, label, summary, frames in group_stacks(answers, thread):
        lines.append("")
        lines.append(f"{label}: {summary}")
        for f in frames:
            lines.append(f"    #{f.get('depth', 0):<3} {f.get('func')} ({f.get('file')}:{f.get('lineno')})")
    for a in answers:
        if not a.ok:
            lines.append("")
            lines.append(f"{a.target.label}: unreachable: {a.error}")
    return "\n".join(lines)
