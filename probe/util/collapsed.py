"""Collapsed stacks (``root;child;leaf count`` per line, as flamegraph.pl, inferno and speedscope read them):
the one escaping of a frame's text, used wherever such stacks are produced (the server's ``/profile``,
py-spy's output read back, the files ``probe profile`` writes).

A frame's text comes from the training process (thread names, function and file names): a newline in it
would start a line of the file that the process chose, and a ``;`` would split one frame into two. Both,
and every other control character, are written as escapes instead.
"""

from __future__ import annotations

import re

__all__ = ["frame_text", "stack_text"]

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(m) -> str:
    ch = m.group(0)
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(
        ch, f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}"
    )


def frame_text(text) -> str:
    """One frame's text, safe inside a collapsed stack.

    >>> frame_text("thread evil\\nrm -rf ~ #;x")
    'thread evil\\\\nrm -rf ~ #,x'
    """
    return _CONTROL.sub(_escape, str(text)).replace(";", ",")


def stack_text(stack) -> str:
    """A whole ``a;b;c`` stack, each frame through ``frame_text`` (the ``;`` between frames kept).

    >>> stack_text("main;f\\x1b[31m")
    'main;f\\\\x1b[31m'
    """
    return ";".join(_CONTROL.sub(_escape, part) for part in str(stack).split(";"))
