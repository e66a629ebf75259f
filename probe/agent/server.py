"""The in-process HTTP/1.1 server: a unix socket by default, TCP when asked.

Requests are served on short-lived daemon threads; a handler holds the GIL only for
the snapshots it takes (DuckDB itself runs without it). Routes are registered with
``@route`` and carry a tier (read < action < eval) that is checked before the
handler runs. Nothing a client does, a disconnect included, raises into the
training thread: handler errors are answered as JSON and kept in ``probe.errors``.
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import socketserver
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Callable
from urllib.parse import parse_qs, urlparse

from .._config import setting
from .._errors import AuthError, ProbeError
from ..util.errorlog import record_error
from .audit import audit

__all__ = ["Request", "route", "ROUTES", "UnixServer", "TCPServer", "check_tier"]

TIERS = ("read", "action", "eval")
MAX_BODY = 16 * 1024 * 1024


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
            raise AuthError("eval is disabled in this process (PROBE_ALLOW_EVAL=0); restart it without that setting to allow eval.")
        if client.get("transport") == "tcp" and allow_eval is not True:
            raise AuthError("eval over TCP is off; start the training process with PROBE_ALLOW_EVAL=1 to allow it (the token is still required), or use the local unix socket.")
    # actions: the unix socket is same-user only, and TCP clients have already shown the token.


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "probe"
    sys_version = ""

    def log_message(self, format, *args):  # quiet: the training job's stderr is not ours
        pass

    def address_string(self):
        return self.server.describe_client(self)

    def _send(self, status: int, payload: dict) -> None:
        body = json.dumps(payload, default=_json_default).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, socket.timeout, OSError):
            pass  # the client went away; nothing to do
        self.close_connection = True

    def _handle(self, method: str) -> None:
        try:
            client = self.server.client_info(self)
        except AuthError as exc:
            _audit_refusal(self, method, {"transport": "tcp", "address": "%s:%s" % self.client_address[:2]}, exc)
            self._send(401 if "token" in exc.message else 403, exc.to_dict())
            return
        url = urlparse(self.path)
        entry = ROUTES.get((method, url.path))
        if entry is None:
            self._send(404, {"error": f"no such endpoint {url.path}; this probe may be older than your CLI.", "kind": "endpoint", "exit_code": 3})
            return
        try:
            body = {}
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                raise ProbeError("request body too large")
            if length:
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise ProbeError("request body must be a JSON object")
            try:
                check_tier(client, entry.tier)
            except AuthError as exc:
                _audit_refusal(self, method, client, exc)
                raise
            req = Request(method, url.path, parse_qs(url.query), body, client)
            payload = entry.fn(req)
            self._send(200, payload)
        except ProbeError as exc:
            self._send(403 if isinstance(exc, AuthError) else 400, exc.to_dict())
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # a bug of ours: keep it, answer, never propagate
            record_error(f"server {method} {url.path}", exc)
            self._send(500, {"error": f"the probe failed internally ({type(exc).__name__}: {exc}); see probe.errors.", "kind": "error", "exit_code": 1})

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")


def _audit_refusal(handler, method: str, client: dict, exc: AuthError) -> None:
    """Refusals of the action and eval tiers go to the audit log like the actions themselves."""
    entry = ROUTES.get((method, urlparse(handler.path).path))
    if entry is not None and entry.tier != "read":
        audit(client, urlparse(handler.path).path.rsplit("/", 1)[-1], {}, "refused", reason=exc.message, tier=entry.tier)


def _json_default(value):
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


class _Base(socketserver.ThreadingMixIn):
    daemon_threads = True
    block_on_close = False
    # socketserver's default backlog is 5; a unix socket refuses with EAGAIN (instead of
    # queueing) once it is full, so a burst of clients (`--ranks all` fan-outs, watch loops)
    # would see spurious failures.
    request_queue_size = 128

    def handle_error(self, request, client_address):
        record_error("server connection")


class UnixServer(_Base, socketserver.UnixStreamServer):
    """Same-user clients only: the directory is 0700 and the peer uid is checked."""

    def __init__(self, path: str):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        old = os.umask(0o177)
        try:
            super().__init__(path, _Handler)
        finally:
            os.umask(old)

    def client_info(self, handler) -> dict:
        pid = uid = None
        try:
            creds = handler.request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _gid = struct.unpack("3i", creds)
        except (OSError, AttributeError):
            pass
        if uid is not None and uid not in (os.getuid(), 0):
            raise AuthError("only the user who runs the training process (or root) may use its probe socket.")
        return {"transport": "unix", "uid": uid, "pid": pid}

    def describe_client(self, handler) -> str:
        return "unix"


class TCPServer(_Base, socketserver.TCPServer):
    """Every request must carry ``Authorization: Bearer <token>``."""

    allow_reuse_address = True

    def __init__(self, host: str, port: int, token: str):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.token = token.encode()
        super().__init__((host, port), _Handler)

    def client_info(self, handler) -> dict:
        header = handler.headers.get("Authorization", "")
        given = header[7:].strip().encode() if header.startswith("Bearer ") else b""
        if not hmac.compare_digest(given, self.token):
            raise AuthError("missing or wrong token; pass --token or set PROBE_TOKEN to the training process's token.")
        host, port = handler.client_address[:2]
        return {"transport": "tcp", "address": f"{host}:{port}"}

    def describe_client(self, handler) -> str:
        return str(handler.client_address[0])


def serve_in_thread(server, name: str) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 3600}, name=name, daemon=True)
    t.start()
    return t
