"""Validation of every number and body a client sends: one place, one clear sentence.

Each function takes the raw value (from JSON or a query string) and the name the user
knows it by, and returns a clean Python value or raises ``QueryError`` (HTTP 400) with a
sentence saying what was wrong and what to send instead. NaN, infinities, booleans posing
as numbers, negative counts and absurd magnitudes never get past here.
"""

from __future__ import annotations

import json
import math

from .._errors import ProbeError
from .printable import printable


MAX_SECONDS = 7 * 24 * 3600.0  # a week: anything longer is a typo, and timers overflow past ~1e9 s
MAX_JSON_DEPTH = 32
MAX_BODY = 1 << 20  # bytes of one request body, for the agent's routes and the page's API alike


class BadRequest(ProbeError):
    """A malformed or out-of-range request value (HTTP 400)."""

    kind = "request"
    exit_code = 2


def number(
    value,
    name: str,
    *,
    default=None,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
) -> float | None:
    """A finite float within bounds.

    >>> number("0.5", "lr")
    0.5
    >>> number("nan", "lr")
    Traceback (most recent call last):
    ...
    probe.util.validate.BadRequest: lr must be a finite number, not 'nan'.
    """
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        raise BadRequest(f"{name} must be a number, not {str(value).lower()}.")
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        raise BadRequest(f"{name} must be a number, not {_show(value)}.") from None
    if not math.isfinite(out):
        raise BadRequest(f"{name} must be a finite number, not {_show(value)}.")
    if minimum is not None and (out <= minimum if exclusive_minimum else out < minimum):
        if minimum == 0:
            raise BadRequest(
                f"{name} must {'be positive' if exclusive_minimum else 'not be negative'}, not {_show(value)}."
            )
        raise BadRequest(
            f"{name} must be {'above' if exclusive_minimum else 'at least'} {minimum:g}, not {_show(value)}."
        )
    if maximum is not None and out > maximum:
        raise BadRequest(f"{name} must be at most {maximum:g}, not {_show(value)}.")
    return out


def seconds(
    value, name: str = "timeout", *, default: float | None = None, maximum: float = MAX_SECONDS
) -> float | None:
    """A positive, finite duration of at most a week (by default).

    >>> seconds("1e300", "timeout")
    Traceback (most recent call last):
    ...
    probe.util.validate.BadRequest: timeout must be at most 604800 seconds, not '1e300'.
    """
    out = number(value, name, default=None, minimum=0.0, exclusive_minimum=True) if value not in (None, "") else default
    if out is not None and out > maximum:
        raise BadRequest(f"{name} must be at most {maximum:g} seconds, not {_show(value)}.")
    return out


def count(value, name: str, *, default: int | None = None, minimum: int = 0, maximum: int = 10**9) -> int | None:
    """A whole number within bounds (``10`` and ``"10"`` pass, ``10.5``, ``-1`` and ``true`` do not).

    >>> count("-1", "max_rows", minimum=1)
    Traceback (most recent call last):
    ...
    probe.util.validate.BadRequest: max_rows must be a whole number from 1 to 1000000000, not '-1'.
    """
    if value is None or value == "":
        return default
    ok = not isinstance(value, bool)
    out = None
    if ok:
        try:
            out = int(value) if not isinstance(value, float) or value.is_integer() else None
        except (TypeError, ValueError, OverflowError):
            out = None
    if out is None or not minimum <= out <= maximum:
        raise BadRequest(f"{name} must be a whole number from {minimum} to {maximum}, not {_show(value)}.")
    return out


def text(value, name: str, *, default: str | None = None, max_len: int = 1 << 20) -> str | None:
    """A string of at most ``max_len`` characters."""
    if value is None:
        return default
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string, not {type(value).__name__}.")
    if len(value) > max_len:
        raise BadRequest(f"{name} is {len(value)} characters long; the limit is {max_len}.")
    return value


def file_path(value, name: str = "path", *, max_len: int = 4096) -> str:
    """A file path that every file function and text file can take: UTF-8 text, no NUL or other control character,
    not ending in ``/``, at most ``max_len`` bytes.

    A lone surrogate (``\\udcff``: a byte the CLI could not decode, or ``\\ud800`` sent as JSON) passes
    ``json.loads`` but breaks ``os.lstat`` or the text files written beside the checkpoint later; a newline or an
    escape would split or recolour every line that shows the path; a trailing ``/`` names a directory.

    >>> file_path("/ckpt/emergency-{rank}.pt")
    '/ckpt/emergency-{rank}.pt'
    >>> file_path("/tmp/a\\ud800.pt")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    probe.util.validate.BadRequest: path has a character that is not UTF-8 text at position 6 (U+D800, a lone
    surrogate, e.g. a byte the shell passed undecoded); give the path in UTF-8.
    """
    out = text(value, name, max_len=max_len)
    if out is None or not out.strip():
        raise BadRequest(f"no {name} given; pass a file path, e.g. /ckpt/emergency-{{rank}}.pt.")
    for i, ch in enumerate(out):
        if 0xD800 <= ord(ch) <= 0xDFFF:
            raise BadRequest(
                f"{name} has a character that is not UTF-8 text at position {i} (U+{ord(ch):04X}, a lone "
                "surrogate, e.g. a byte the shell passed undecoded); give the path in UTF-8."
            )
    if "\0" in out:
        raise BadRequest(f"{name} has a NUL character at position {out.index(chr(0))}; give a plain file path.")
    control = next((i for i, ch in enumerate(out) if ch < " " or "\x7f" <= ch <= "\x9f"), None)
    if control is not None:
        raise BadRequest(
            f"{name} has a control character at position {control} ({printable(out[control])}); give a plain file path."
        )
    if out.endswith("/"):
        raise BadRequest(f"{name} {printable(out)} ends with /, which names a directory; give the path of a file.")
    if len(out.encode()) > max_len:
        raise BadRequest(f"{name} is {len(out.encode())} bytes long; a path has at most {max_len}.")
    return out


def _too_deep(value, limit: int) -> bool:
    """Whether a parsed JSON value nests deeper than ``limit`` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


def json_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """A request body: a JSON object nesting at most ``max_depth`` deep.

    >>> json_body(b'{"a": 1}')
    {'a': 1}
    >>> json_body(b'[' * 5000)
    Traceback (most recent call last):
    ...
    probe.util.validate.BadRequest: the request body nests deeper than 32 levels; send a flat JSON object.
    """
    if not raw.strip():
        return {}
    deep = BadRequest(f"the request body nests deeper than {max_depth} levels; send a flat JSON object.")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise deep from None
    except ValueError:
        raise BadRequest(
            'the request body is not valid JSON (UTF-8); send a JSON object such as {"tables": {...}}.'
        ) from None
    if _too_deep(body, max_depth):
        raise deep
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, not a {type(body).__name__}.")
    return body


def request_body(raw_length: str | None, rfile, max_bytes: int = MAX_BODY) -> dict:
    """The JSON object of an HTTP request whose ``Content-Length`` header is ``raw_length``, read from ``rfile``."""
    if raw_length in (None, ""):
        return {}
    try:
        length = int(raw_length)
    except ValueError:
        length = -1
    if length < 0:
        raise BadRequest(f"Content-Length must be a whole number of bytes, not {raw_length[:20]!r}.")
    if length > max_bytes:
        exc = BadRequest(f"the request body is {length} bytes; the limit is {max_bytes} bytes.")
        exc.kind = "too_large"
        raise exc
    if not length:
        return {}
    raw = rfile.read(length)
    if len(raw) < length:
        raise BadRequest("the request body ended before its Content-Length; resend the request.")
    return json_body(raw)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
