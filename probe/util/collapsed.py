"""Collapsed stacks (``root;child;leaf count`` per line, as flamegraph.pl, inferno and speedscope read them):
the one escaping of a frame's text, used wherever such stacks are produced (the server's ``/profile``,
py-spy's output read back, the files ``probe profile`` writes).

A frame's text comes from the training process (thread names, function and file names): a newline in it
would start a line of the file that the process chose, and a ``;`` would split one frame into two. Both,
and every other control character, are written as escapes instead.
"""

from __future__ import annotations

from .printable import escape_controls

__all__ = ["frame_text", "stack_text"]


def frame_text(text) -> str:
    """One frame's text, safe inside a collapsed stack.

    >>> frame_text("thread evil\\nrm -rf ~ #;x")
    'thread evil\\\\nrm -rf ~ #,x'
    """
    return escape_controls(text).replace(";", ",")


def stack_text(stack) -> str:
    """A whole ``a;b;c`` stack, each frame through ``frame_text`` (the ``;`` between frames kept).

    >>> stack_text("main;f\\x1b[31m")
    'main;f\\\\x1b[31m'
    """
    return ";".join(escape_controls(part) for part in str(stack).split(";"))
