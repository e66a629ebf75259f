"""Native frames for a live, answering process: py-spy's native stacks merged with the probe's.

The probe's server sees only Python frames (with locals, thread names and daemon
flags); py-spy ``--native`` sees C/C++ frames too, interleaved with the Python ones.
The two are read a moment apart, so a running thread may have moved: the merge walks
each thread's Python frames from the outermost in and takes the probe's frame (richer)
while the two agree on function and file; from the first disagreement inwards it keeps
py-spy's frames, which are consistent with its native ones. Threads only one side saw
are kept as that side reported them.
"""

from __future__ import annotations

import os

__all__ = ["merge_native"]


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
