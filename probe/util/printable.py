"""Text another process chose, made safe to show: the one escaping of it, the one escaping of collapsed stacks,
and the one redaction of secrets.

Thread, function and file names, table cells, argv, exception messages, a server's error text and paths
come from processes and endpoints that may be hostile. Raw, their control characters would let them write
the user's clipboard (OSC 52), move the cursor over lines, start a line of a file, or reorder what a line
shows (the bidirectional overrides). Every C0 and C1 control, DEL, the bidirectional embeddings, overrides
and isolates, the Unicode line and paragraph separators and lone surrogates are written as escapes.

Collapsed stacks (``root;child;leaf count`` per line, as flamegraph.pl, inferno and speedscope read them) are
produced by the server's ``/profile``, from py-spy's output read back, and in the files ``probe profile``
writes: in a frame's text a newline would start a line of the file that the process chose, and a ``;`` would
split one frame into two, so ``frame_text`` and ``stack_text`` escape both.

Secrets, in environment variables and frame locals alike: a value is hidden when its *name* looks secret
(``api_token``, ``HF_TOKEN``, ``db_password``, ``aws_secret_access_key``...), and any part of a value that has
the *shape* of a well-known credential (a Hugging Face, OpenAI, GitHub, Slack or AWS key, a bearer header) is
hidden wherever it appears: a local ``cfg = {'token': 'hf_...'}`` is shown as a dict whose value is redacted.
"""

from __future__ import annotations

import os
import re


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


REDACTED = "<redacted>"
SECRET_NAME = re.compile(r"TOKEN|SECRET|KEY|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE", re.IGNORECASE)
_SHAPES = re.compile(
    r"hf_[A-Za-z0-9]{20,}"  # Hugging Face
    r"|sk-[A-Za-z0-9_\-]{20,}"  # OpenAI and alike
    r"|gh[pousr]_[A-Za-z0-9]{20,}"  # GitHub
    r"|github_pat_[A-Za-z0-9_]{20,}"
    r"|xox[abprs]-[A-Za-z0-9\-]{10,}"  # Slack
    r"|(?:AKIA|ASIA)[A-Z0-9]{16}"  # AWS access key id
    r"|(?i:bearer)\s+[A-Za-z0-9._~+/=\-]{16,}"  # an Authorization header's value
)


def looks_secret(name: str) -> bool:
    """Whether a variable's name says its value is a secret.

    >>> looks_secret("api_token"), looks_secret("HF_TOKEN"), looks_secret("steps")
    (True, True, False)
    """
    return bool(SECRET_NAME.search(str(name)))


def redact(name: str, value: str) -> str:
    """``value`` as probe may show it: all of it hidden under a secret-looking name, else only its credential-shaped
    parts.

    >>> redact("api_token", "hf_abcdefghijklmnopqrstuvwx")
    '<redacted>'
    >>> redact("cfg", "{'auth': 'hf_abcdefghijklmnopqrstuvwx', 'lr': 0.1}")
    "{'auth': '<redacted>', 'lr': 0.1}"
    >>> redact("lr", "0.1")
    '0.1'
    """
    if looks_secret(name):
        return REDACTED
    if not isinstance(value, str):
        return value
    return _SHAPES.sub(REDACTED, value)
