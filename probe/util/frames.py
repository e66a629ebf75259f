"""Reading a live frame's locals without keeping them alive.

On Python 3.11 and 3.12, ``frame.f_locals`` of a function frame is a snapshot dict
cached on the frame: whatever it references stays alive until the next time someone
reads ``f_locals``. Read once per step from the training loop's frame, it kept the
previous step's ``logits``/``batch`` alive through the next step's backward pass,
which raises peak memory by those tensors (large on GPUs). Python 3.13 (PEP 667)
returns a write-through proxy instead, and nothing needs releasing.

``release`` empties that snapshot after a read. It does so only on the thread that
owns the frame and only when that thread has no trace or profile function: the
only write-back of the snapshot into the frame (``PyFrame_LocalsToFast``) runs in
the trace/profile trampoline, which first refreshes the snapshot from the frame,
so an emptied snapshot can never wipe a variable.
"""

from __future__ import annotations

import sys

__all__ = ["release"]

_SNAPSHOTS = sys.version_info < (3, 13)


def _on_this_thread(frame) -> bool:
    f = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


def release(frame, loc: dict, *, own: bool = False) -> None:
    """Drop the references held by ``frame``'s cached locals snapshot ``loc`` (3.11/3.12).

    ``own=True`` says the caller knows ``frame`` is on the current thread's stack (the
    step boundary, which found it by walking that stack), which skips the check.
    """
    if not _SNAPSHOTS or type(loc) is not dict or loc is frame.f_globals:
        return
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return  # a debugger or profiler owns the snapshot's write-back: leave it alone
    if not own and not _on_this_thread(frame):
        return  # another thread's frame: its tracer state is not ours to judge
    loc.clear()
