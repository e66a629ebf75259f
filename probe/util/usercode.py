"""The one definition of "user code" (which frames are the user's, for the agent and the CLI alike), and reading a
frame's locals without keeping them alive.

A file is the user's unless it belongs to

* the standard library (``<frozen ...>`` modules too; ``<stdin>``, ``<string>`` and a
  notebook's cells are the user's),
* probe itself, torch, or a training framework (``FRAMEWORK_PACKAGES``: the frames of
  Lightning's or the transformers Trainer's loop are the framework's, not the user's).

Any other installed package counts as the user's: a training loop may live in the user's
own package, installed like any other, and the step boundary must find it there.

The rule reads a file name only, so the CLI applies it to the frames of a process it
cannot look into (a backtrace, py-spy's stacks): an installed package is recognised by its
``site-packages/<name>/`` (or ``dist-packages``) folder and the standard library by its
``lib/pythonX.Y/`` one. In the process itself, the folders of probe and of the torch and
framework modules it has imported count as well, so that an editable install (probe's own
worktree, a framework checked out with ``pip install -e``) is recognised too.

Reading a frame's locals without keeping them alive (``release``): on Python 3.11 and 3.12,
``frame.f_locals`` of a function frame is a snapshot dict cached on the frame: whatever it references
stays alive until the next time someone reads ``f_locals``. Read once per step from the training loop's
frame, it kept the previous step's ``logits``/``batch`` alive through the next step's backward pass,
which raises peak memory by those tensors (large on GPUs). Python 3.13 (PEP 667) returns a write-through
proxy instead, and nothing needs releasing. ``release`` empties that snapshot after a read, only on the
thread that owns the frame and only when that thread has no trace or profile function: the only
write-back of the snapshot into the frame (``PyFrame_LocalsToFast``) runs in the trace/profile
trampoline, which first refreshes the snapshot from the frame, so an emptied snapshot can never wipe a
variable.

>>> is_user_file("/opt/venv/lib/python3.12/site-packages/torch/optim/optimizer.py")
False
>>> is_user_file("/opt/venv/lib/python3.12/site-packages/torchvision/models/resnet.py")
True
>>> is_user_file("/usr/lib/python3.12/threading.py"), is_user_file("<frozen runpy>"), is_user_file("<stdin>")
(False, False, True)
>>> is_user_file("/home/me/train.py")
True
"""

from __future__ import annotations

import os
import re
import sys


# packages whose frames are the framework's, not the user's loop
FRAMEWORK_PACKAGES = (
    "lightning",
    "lightning_fabric",
    "pytorch_lightning",
    "lightning_utilities",
    "transformers",
    "accelerate",
    "deepspeed",
    "trl",
    "peft",
    "torchmetrics",
)
LIBRARY_PACKAGES = frozenset(("probe", "torch") + FRAMEWORK_PACKAGES)

_INSTALLED = re.compile(r"[/\\](?:site|dist)-packages[/\\]([A-Za-z0-9_.]+)")
_STDLIB = re.compile(r"[/\\]lib(?:64)?[/\\]python\d+(?:\.\d+)?t?[/\\](?!(?:site|dist)-packages[/\\])")
_PROBE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # probe/ (this file is in probe/util)


def _loaded_roots() -> tuple[str, ...]:
    """probe's folder and those of the torch and framework packages imported here (editable installs too)."""
    dirs = [_PROBE_DIR]
    for pkg in LIBRARY_PACKAGES:
        path = getattr(sys.modules.get(pkg), "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)))
    return tuple(d + os.sep for d in dirs)


def is_user_file(path: str, roots: tuple[str, ...] | None = None) -> bool:
    """Whether code in ``path`` is the user's (see the module's docstring); ``roots``: library folders
    besides the ones a path names by itself (default: those loaded in this process)."""
    path = str(path)
    if path.startswith("<"):
        return not path.startswith("<frozen")
    p = os.path.abspath(path)
    installed = _INSTALLED.search(p)
    if installed:
        return installed.group(1).split(".")[0] not in LIBRARY_PACKAGES
    if _STDLIB.search(p):
        return False
    return not p.startswith(_loaded_roots() if roots is None else roots)


_USER: dict = {}  # co_filename -> is_user_file (a frame walk at every step boundary reads it)


def is_user_code(code) -> bool:
    """``is_user_file`` of a code object's file, cached per file."""
    f = code.co_filename
    hit = _USER.get(f)
    if hit is None:
        hit = _USER[f] = is_user_file(f)
    return hit


def user_frame(frame) -> tuple:
    """``(f, hops)``: the nearest frame from ``frame`` outwards that is the user's code (None if none),
    and how many frames out it is."""
    hops = 0
    while frame is not None and not is_user_code(frame.f_code):
        frame, hops = frame.f_back, hops + 1
    return frame, hops


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
