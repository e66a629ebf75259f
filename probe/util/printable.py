"""Text another process chose, made safe for a terminal and for line-based files: the one escaping of it.

Thread, function and file names, table cells, argv, exception messages, a server's error text and paths
come from processes and endpoints that may be hostile. Raw, their control characters would let them write
the user's clipboard (OSC 52), move the cursor over lines, start a line of a file, or reorder what a line
shows (the bidirectional overrides). Every C0 and C1 control, DEL, the bidirectional embeddings, overrides
and isolates, the Unicode line and paragraph separators and lone surrogates are written as escapes.
"""

from __future__ import annotations

import os
import re

__all__ = ["escape_controls", "terminal_text", "printable"]

_UNSAFE = "\u202a-\u202e\u2066-\u2069\u2028\u2029\ud800-\udfff"  # reorder a line, break it, or cannot be encoded
_CONTROLS = re.compile(f"[\x00-\x1f\x7f-\x9f{_UNSAFE}]")
_CONTROLS_BUT_LAYOUT = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_UNSAFE}]")  # keeps \n and \t
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escaped(match: re.Match) -> str:
    c = match.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def escape_controls(text) -> str:
    r"""One value: every control character, DEL and bidi override escaped, newlines included.

    >>> print(escape_controls("a\x1b]52;c;SGk=\x07b\nc\u202e"))
    a\x1b]52;c;SGk=\x07b\nc\u202e
    """
    text = str(text)
    return _CONTROLS.sub(_escaped, text) if _CONTROLS.search(text) else text


def terminal_text(text) -> str:
    r"""Lines for a terminal: like ``escape_controls`` but the layout's newlines and tabs stay.

    >>> terminal_text("one\x1b[1A\x1b[2K\r\ntwo\tthree\x9b").split("\n")
    ['one\\x1b[1A\\x1b[2K\\r', 'two\tthree\\x9b']
    """
    text = str(text)
    return _CONTROLS_BUT_LAYOUT.sub(_escaped, text) if _CONTROLS_BUT_LAYOUT.search(text) else text


def printable(path) -> str:
    """A path for one line of a message (undecodable bytes kept as surrogate escapes, then escaped).

    >>> printable("/ckpt/a\\nb\\x1b[31m.pt")
    '/ckpt/a\\\\nb\\\\x1b[31m.pt'
    """
    return escape_controls(os.fsdecode(path) if isinstance(path, bytes) else path)
