"""The server's routes: ``@route(method, path, tier)`` registers a handler, ``check_tier`` guards it.

A handler takes a :class:`Request` (its query parameters and JSON body, and who the client
is) and returns a JSON-able dict, or a :class:`Binary` answer (buffers sent as they are). Each
route has a tier, read < action < eval: actions need the unix socket (same user) or the token;
eval also needs PROBE_ALLOW_EVAL over TCP, and is off everywhere with PROBE_ALLOW_EVAL=0.
Route modules (``routes``, ``action_routes``, ``profile``) register themselves when imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..config import setting
from .._errors import AuthError

__all__ = ["Request", "Binary", "Route", "route", "ROUTES", "TIERS", "check_tier"]

TIERS = ("read", "action", "eval")


@dataclass
class Binary:
    """A non-JSON answer: buffers sent one after the other (no concatenated copy)."""

    parts: list
    content_type: str = "application/octet-stream"


@dataclass
class Request:
    method: str
    path: str
    params: dict
    body: dict
    client: dict = field(default_factory=dict)

    def param(self, name: str, default=None):
        if name in self.body:
            return self.body[name]
        values = self.params.get(name)
        return values[-1] if values else default


@dataclass(frozen=True)
class Route:
    fn: Callable[[Request], dict]
    tier: str


ROUTES: dict[tuple[str, str], Route] = {}


def route(method: str, path: str, tier: str = "read"):
    """Register ``fn(request) -> dict`` as the handler of ``method path``."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}")

    def register(fn):
        ROUTES[(method.upper(), path)] = Route(fn, tier)
        return fn

    return register


def check_tier(client: dict, tier: str) -> None:
    """Refuse with one sentence naming the setting that would allow it."""
    if tier == "read":
        return
    allow_eval = setting("PROBE_ALLOW_EVAL")
    if tier == "eval":
        if allow_eval is False:
            raise AuthError(
                "eval is disabled in this process (PROBE_ALLOW_EVAL=0); restart it without that setting to allow eval."
            )
        if client.get("transport") == "tcp" and allow_eval is not True:
            raise AuthError(
                "eval over TCP is off; start the training process with PROBE_ALLOW_EVAL=1 to allow it (the token is "
                "still required), or use the local unix socket."
            )
    # actions: the unix socket is same-user only, and TCP clients have already shown the token.
