"""The one redaction of secrets in what probe shows: environment variables and frame locals alike.

A value is hidden when its *name* looks secret (``api_token``, ``HF_TOKEN``, ``db_password``,
``aws_secret_access_key``...), and any part of a value that has the *shape* of a well-known
credential (a Hugging Face, OpenAI, GitHub, Slack or AWS key, a bearer header) is hidden wherever
it appears: a local ``cfg = {'token': 'hf_...'}`` is shown as a dict whose value is redacted.
"""

from __future__ import annotations

import re

__all__ = ["SECRET_NAME", "REDACTED", "redact", "looks_secret"]

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
