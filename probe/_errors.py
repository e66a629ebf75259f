"""The one error tree of probe.

::

    ProbeError                 anything probe reports to a user (exit code 1)
    ├── QueryError             bad or refused SQL; keeps sqlglot's line/column
    ├── EndpointError          no such pid, no probe there, connection refused (exit 3)
    ├── AuthError              missing or wrong token, tier not enabled (exit 4)
    ├── ActionError            a guarded action failed or was refused (exit 5)
    ├── AttachError            the attach ladder could not attach (exit_code set per cause)
    └── PartialError           some ranks answered and some did not (exit 7)

Every message is one plain sentence that says what was wrong and how to fix it.
``probe.cli.main`` catches ``ProbeError``, prints the message and returns
``exit_code``: users never see our tracebacks.
"""

from __future__ import annotations


class ProbeError(Exception):
    """Base class: a message for the user and the exit code the CLI returns."""

    exit_code = 1
    kind = "error"

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        if exit_code is not None:
            self.exit_code = exit_code

    def to_dict(self) -> dict:
        return {"error": self.message, "kind": self.kind, "exit_code": self.exit_code}


class QueryError(ProbeError):
    """Refused or failed SQL. ``line``/``col`` come from sqlglot when it could not parse; ``table`` names the
    table the query asked for and the process does not have, when that is why it was refused."""

    exit_code = 2
    kind = "query"

    def __init__(self, message: str, *, line: int | None = None, col: int | None = None, table: str | None = None):
        super().__init__(message)
        self.line = line
        self.col = col
        self.table = table

    def to_dict(self) -> dict:
        d = super().to_dict()
        d.update(line=self.line, col=self.col)
        return d


class EndpointError(ProbeError):
    """The endpoint could not be reached or does not run a probe."""

    exit_code = 3
    kind = "endpoint"


class AuthError(ProbeError):
    """A missing or wrong token, or a tier (actions, eval) not enabled for this client."""

    exit_code = 4
    kind = "auth"


class ActionError(ProbeError):
    """A guarded action was refused, failed or timed out."""

    exit_code = 5
    kind = "action"


class AttachError(ProbeError):
    """A rung of the attach ladder failed; the message says why and what to change."""

    exit_code = 6
    kind = "attach"


class PartialError(ProbeError):
    """Some ranks answered and some did not: what was shown is a partial answer."""

    exit_code = 7
    kind = "partial"


_KINDS = {
    cls.kind: cls for cls in (ProbeError, QueryError, EndpointError, AuthError, ActionError, AttachError, PartialError)
}


def error_from_dict(d: dict) -> ProbeError:
    """Rebuild an error sent by the server (``to_dict``) on the client side."""
    cls = _KINDS.get(d.get("kind", "error"), ProbeError)
    if cls is QueryError:
        return QueryError(d.get("error", "query failed"), line=d.get("line"), col=d.get("col"))
    err = cls(d.get("error", "the probe reported an error"))
    if cls is ProbeError and isinstance(d.get("kind"), str):
        err.kind = d["kind"]  # a kind with no class of its own (``busy``) is kept for the caller to tell
    if d.get("exit_code") is not None:
        err.exit_code = int(d["exit_code"])
    return err


def exception_text(exc: BaseException, limit: int = 160) -> str:
    """Another library's exception as a short phrase for a sentence: its type and the first line of its message
    (messages such as sqlglot's quote the query on further lines).

    >>> exception_text(IndexError("list index out of range"))
    'IndexError: list index out of range'
    >>> exception_text(ValueError("one\\ntwo")), exception_text(KeyError())
    ('ValueError: one', 'KeyError')
    """
    first = (str(exc).strip().splitlines() or [""])[0][:limit]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
