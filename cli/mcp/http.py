"""``probe mcp --http``: the same MCP server over the SDK's streamable HTTP transport.

Glue only. The SDK builds the Starlette app (session manager, bearer-token middleware that
answers 401, Host/Origin checks against DNS rebinding) and uvicorn serves it. Ours are the
rules: bind loopback unless the person asked otherwise, always require a token (one per
run, or ``PROBE_MCP_TOKEN``) compared in constant time, accept only the Host and Origin
names this server is reached under, and stop cleanly on SIGINT or SIGTERM.

The token is deliberately not ``PROBE_TOKEN``: that one opens the training processes' TCP
endpoints (actions included), so an agent holding it could bypass the tool set chosen here.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import signal
import socket
from typing import Callable

import uvicorn
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.transport_security import TransportSecuritySettings

from probe._errors import ProbeError
from probe.util.handshake import LOOPBACK_NAMES, host_names, is_loopback

from .server import build_server


PATH = "/mcp"
_TOKEN_OK = re.compile(r"^[A-Za-z0-9._~+/=-]{16,}$")  # RFC 6750's token68 characters, and not guessable by length


def parse_address(text: str) -> tuple[str, int]:
    """``[HOST:]PORT`` → (host, port); the host defaults to 127.0.0.1, an IPv6 one goes in brackets.

    >>> parse_address("8080"), parse_address("localhost:0"), parse_address("[::1]:9000")
    (('127.0.0.1', 8080), ('localhost', 0), ('::1', 9000))
    """
    host, sep, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ProbeError(f"--http {text}: write an IPv6 address in brackets, e.g. [::1]:8000.")
    if not port.isdigit() or not 0 <= int(port) <= 65535 or (sep and not host):
        raise ProbeError(
            f"--http {text} is not [HOST:]PORT with a port from 0 to 65535 (0 picks a free one); "
            "e.g. --http 8000 or --http 127.0.0.1:0."
        )
    return host or "127.0.0.1", int(port)


def http_token(environ_value: str | None) -> tuple[str, bool]:
    """The bearer token and whether it was generated here (else it came from PROBE_MCP_TOKEN)."""
    if environ_value is None or not environ_value.strip():
        return secrets.token_urlsafe(32), True
    value = environ_value.strip()
    if not _TOKEN_OK.match(value):
        raise ProbeError(
            "PROBE_MCP_TOKEN must be at least 16 characters of letters, digits and ._~+/=- "
            "(e.g. from `python -c 'import secrets; print(secrets.token_urlsafe(32))'`), or unset "
            "to have one generated."
        )
    return value, False


class _Token:
    """The SDK's TokenVerifier: one shared secret, compared in constant time."""

    def __init__(self, token: str):
        self._token = token.encode()

    async def verify_token(self, token: str):
        if hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self._token):
            return AccessToken(token="(bearer)", client_id="probe-mcp-client", scopes=[])
        return None


def _listen(host: str, port: int, expose: bool) -> socket.socket:
    """A listening socket; an address that is not loopback (as resolved, not as spelled) needs ``expose``."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
            0
        ]
    except OSError as exc:
        raise ProbeError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --http address."
        ) from None
    if not expose and not is_loopback(addr[0].split("%")[0]):
        raise ProbeError(
            f"--http {host}:{port}: {host} is not a loopback address; add --expose to serve MCP there "
            "(anyone who can reach it and has the token can use the tools), or keep 127.0.0.1 and tunnel with ssh -L."
        )
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise ProbeError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --http address."
        ) from None
    sock.setblocking(False)
    return sock


def _security(hosts: list[str]):
    """DNS-rebinding protection (the SDK's): a request naming another Host (``host_names``), or a web page of
    another origin, is refused."""
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=[f"http://{h}" for h in hosts]
    )


def _quiet_logs(server) -> None:
    """The SDK's refusals (a bad Host or Origin) as one line each; no noise from streams cut at shutdown."""
    sdk = logging.getLogger("mcp")
    if not sdk.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("probe mcp: %(message)s"))
        sdk.addHandler(handler)
        sdk.setLevel(logging.WARNING)
        sdk.propagate = False
    # an open event stream ends with the session manager when we stop; uvicorn calls that an error
    logging.getLogger("uvicorn.error").addFilter(
        lambda record: not (server.should_exit and "without completing response" in record.getMessage())
    )


def serve_http(
    host: str,
    port: int,
    *,
    token: str,
    announce: Callable[[str, bool], None],
    expose: bool = False,
    allow_actions: bool = False,
    timeout: float | None = None,
    output_dir: str | None = None,
) -> None:
    """Listen on ``host:port``, call ``announce(url, loopback)`` once bound, serve until SIGINT or SIGTERM."""
    sock = _listen(host, port, expose)
    bound, port = sock.getsockname()[:2]
    names = host_names(host, bound)
    url_host = (
        names[len(LOOPBACK_NAMES)] if len(names) > len(LOOPBACK_NAMES) else (f"[{bound}]" if ":" in bound else bound)
    )
    url = f"http://{url_host}:{port}{PATH}"
    app = build_server(allow_actions, timeout, output_dir).streamable_http_app(
        streamable_http_path=PATH,
        host=host,
        transport_security=_security(host_names(host, bound, port)),
        # Resource-server settings with no OAuth server: the SDK then only checks bearer tokens with the
        # verifier (issuer_url is required by the model but unused without an authorization server).
        auth=AuthSettings(issuer_url=url, resource_server_url=None),
        token_verifier=_Token(token),
    )
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", server_header=False, timeout_graceful_shutdown=3
    )
    server = uvicorn.Server(config)
    _quiet_logs(server)
    # uvicorn stops gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler it found:
    # make both end here as KeyboardInterrupt (also before uvicorn installs its own handlers).
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        announce(url, is_loopback(bound.split("%")[0]))
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
