"""The in-process HTTP/1.1 server's request handling and its routes (the listeners, a unix socket by default and
TCP when asked, are ``listeners``).

``@route(method, path, tier)`` registers a handler: it takes a :class:`Request` (its query
parameters and JSON body, and who the client is) and returns a JSON-able dict, or a
:class:`Binary` answer (buffers sent as they are). Each route has a tier, read < action < eval,
checked (``check_tier``) before the handler runs: actions need the unix socket (same user) or the
token; eval also needs PROBE_ALLOW_EVAL over TCP, and is off everywhere with PROBE_ALLOW_EVAL=0.
Route modules (``routes``, ``action_routes``) register themselves when imported.

Nothing a client does, a disconnect included, raises into the training thread: handler errors are answered
as JSON and kept in ``probe.errors``. Every request is bounded per listener (docs/security.md has the table):
the head has one deadline for all its bytes (``PROBE_READ_TIMEOUT``) and at most ``MAX_HEAD`` bytes, and over
TCP the ``Authorization`` header (``probe.util.handshake``) is checked as soon as its line arrives, within the
first ``MAX_HEAD_BEFORE_AUTH`` bytes; bodies are JSON objects of at most ``MAX_BODY`` bytes and
``MAX_JSON_DEPTH`` levels (``probe.util.validate``).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlparse
from dataclasses import dataclass, field
from typing import Callable

from .._errors import AuthError, EndpointError, ProbeError
from ..util.errorlog import record_error
from ..util.validate import BadRequest, request_body
from .._core.audit import audit
from ..config import setting


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


MAX_HEAD = 16 * 1024  # request line and headers: our clients send a few hundred bytes
MAX_HEAD_BEFORE_AUTH = 4 * 1024  # over TCP, what a client may send before its Authorization line


class _HeadRefused(Exception):
    def __init__(self, status: int, payload: dict, path: str = ""):
        super().__init__(status)
        self.status, self.payload, self.path = status, payload, path


def _path_of(head: bytes) -> str:
    """The target of a head's request line ('' when it has none)."""
    words = bytes(head).split(b"\n", 1)[0].split()
    return words[1].decode("latin-1") if len(words) >= 2 else ""


class _Head:
    """The request's head as read by ``_Handler.read_head``, then the rest of the stream: what the stdlib's
    request parsing reads from (``readline``) and the body reader after it (``read``)."""

    def __init__(self, head: bytes, rest):
        import io

        self._head, self._rest = io.BytesIO(head), rest

    def readline(self, size: int = -1) -> bytes:
        line = self._head.readline(size)
        if line.endswith(b"\n") or (size >= 0 and len(line) >= size):
            return line
        return line + self._rest.readline(-1 if size < 0 else size - len(line))

    def read(self, size: int = -1) -> bytes:
        data = self._head.read(size)
        if size < 0:
            return data + self._rest.read()
        return data + self._rest.read(size - len(data)) if len(data) < size else data

    def close(self) -> None:
        self._rest.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "probe"
    sys_version = ""

    def log_message(self, format, *args):  # quiet: the training job's stderr is not ours
        pass

    def setup(self):
        self.timeout = self.server.read_timeout
        super().setup()

    def handle(self):
        """Read the head under its own deadline and byte caps (``read_head``), then serve the one request."""
        try:
            head = self.read_head()
        except _HeadRefused as exc:
            _count_request(self.server.transport)
            self.request_version, self.requestline, self.command, self.path = "HTTP/1.1", "", None, exc.path
            if exc.status == 401:
                for method in ("GET", "POST"):
                    if (method, urlparse(exc.path).path) in ROUTES:
                        _audit_refusal(
                            self,
                            method,
                            {"transport": "tcp", "address": "%s:%s" % self.client_address[:2]},
                            AuthError(_WRONG_TOKEN),
                        )
                        break
            self._send(exc.status, exc.payload)
            return
        except OSError:  # timed out, reset: nothing to answer
            return
        self.rfile = _Head(head, self.rfile)
        self.handle_one_request()

    def read_head(self) -> bytes:
        """The request line and headers, read with one deadline for all of them (``PROBE_READ_TIMEOUT``) and
        at most ``MAX_HEAD`` bytes; over TCP, the Authorization header is checked as soon as its line is complete
        (a challenge is answered there with the rank's proof, ``probe.util.handshake``)."""
        sock = self.connection
        deadline = time.monotonic() + self.server.read_timeout
        buf = bytearray()
        scanned = 0  # the lines before this offset were looked at
        authorized = self.server.transport != "tcp"
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0 and buf.find(b"\n\n") >= 0:
                end = buf.find(b"\n\n")
            # look at every complete header line once: the Authorization one decides at once
            while not authorized:
                nl = buf.find(b"\n", scanned)
                if nl < 0:
                    break
                line = bytes(buf[scanned:nl]).strip()
                scanned = nl + 1
                if line.lower().startswith(b"authorization:"):
                    verdict = self.server.authorize(line.split(b":", 1)[1].strip(), bytes(buf[: buf.find(b"\n")]))
                    if verdict.answer is not None:  # a challenge: the proof, and no route is touched
                        raise _HeadRefused(401, verdict.answer)
                    if not verdict.ok:
                        raise _HeadRefused(401, AuthError(_WRONG_TOKEN).to_dict(), _path_of(buf))
                    authorized = self.authorized = True
                elif not line and scanned > 2:  # the end of the head, without the token
                    raise _HeadRefused(401, AuthError(_WRONG_TOKEN).to_dict(), _path_of(buf))
            if end >= 0:
                return bytes(buf)
            first = buf.find(b"\n")
            if first >= 0 and len(buf[:first].split()) == 2:
                return bytes(buf)  # HTTP/0.9: no headers follow; parse_request answers it
            limit = MAX_HEAD if authorized else MAX_HEAD_BEFORE_AUTH
            if len(buf) > limit:
                what = "request headers" if authorized else "request headers before the Authorization header"
                raise _HeadRefused(431, BadRequest(f"the {what} pass {limit} bytes.").to_dict())
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("request head")
            sock.settimeout(left)
            chunk = sock.recv(min(4096, limit + 1 - len(buf)))
            if not chunk:
                return bytes(buf)  # the client stopped sending: parse what came
            buf += chunk
            sock.settimeout(self.server.read_timeout)

    def parse_request(self):
        # An HTTP/0.9 request line ("GET /path") has no headers, but the stdlib would wait for
        # them until the client gives up: answer at once instead.
        words = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n").split()
        if len(words) == 2:
            self.command, self.request_version = None, "HTTP/1.1"
            self.requestline = " ".join(words)
            self.close_connection = True
            self.send_error(400)
            return False
        return super().parse_request()

    def send_error(self, code, message=None, explain=None):
        """The stdlib's errors (bad request line, HTTP/0.9, long headers) as one JSON sentence, then close."""
        if self.request_version == "HTTP/0.9" or not getattr(self, "requestline", ""):
            self.request_version = "HTTP/1.1"  # answer with a status line the client can read
        text = {
            400: "malformed HTTP request; probe speaks HTTP/1.1 (use the probe CLI)",
            414: "request line too long",
            431: "request headers too large",
            501: "unsupported method; probe answers GET and POST",
            505: "unsupported HTTP version; probe speaks HTTP/1.1",
        }.get(code, message or "bad request")
        self._send(code, BadRequest(text + ".").to_dict())

    def _respond(self, status: int, parts: list, content_type: str) -> None:
        """Status line, headers and body in one gathered send (each socket call lets the training thread's GIL go)."""
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.1"
        parts = [p for p in parts if (p.nbytes if hasattr(p, "nbytes") else len(p))]
        length = sum(p.nbytes if hasattr(p, "nbytes") else len(p) for p in parts)
        reason = self.responses.get(status, ("",))[0]
        head = (
            f"HTTP/1.1 {status} {reason}\r\nServer: probe\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        try:
            send_buffers(self.connection, [head, *parts])
        except (BrokenPipeError, ConnectionResetError, socket.timeout, OSError):
            pass  # the client went away; nothing to do
        self.close_connection = True

    def address_string(self):
        return self.server.describe_client(self)

    def _send(self, status: int, payload: dict) -> None:
        self._respond(status, [json.dumps(payload, default=_json_default).encode()], "application/json")

    def _handle(self, method: str) -> None:
        _count_request(self.server.transport)
        try:
            client = self.server.client_info(self)
        except AuthError as exc:
            _audit_refusal(self, method, {"transport": "tcp", "address": "%s:%s" % self.client_address[:2]}, exc)
            self._send(401 if "token" in exc.message else 403, exc.to_dict())
            return
        agent = self.headers.get("X-Probe-Agent")
        if agent:  # the program acting for the user (e.g. an MCP client): a label for the audit, not a credential
            client["agent"] = "".join(ch for ch in agent[:64] if ch.isprintable())
        url = urlparse(self.path)
        entry = ROUTES.get((method, url.path))
        if entry is None:
            self._send(
                404, EndpointError(f"no such endpoint {url.path}; this probe may be older than your CLI.").to_dict()
            )
            return
        try:
            try:
                check_tier(client, entry.tier)
            except AuthError as exc:
                _audit_refusal(self, method, client, exc)
                raise
            body = request_body(self.headers.get("Content-Length"), self.rfile)
            req = Request(method, url.path, parse_qs(url.query), body, client)
            payload = entry.fn(req)
            if isinstance(payload, Binary):
                self._respond(200, payload.parts, payload.content_type)
            else:
                self._send(200, payload)
        except ProbeError as exc:
            status = 403 if isinstance(exc, AuthError) else {"busy": 503, "too_large": 413}.get(exc.kind, 400)
            self._send(status, exc.to_dict())
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            pass
        except RecursionError as exc:
            record_error(f"server {method} {url.path}", exc)
            self._send(400, BadRequest("the request nests too deeply to handle; send a simpler request.").to_dict())
        except BaseException as exc:  # a bug of ours, or KeyboardInterrupt/SystemExit from eval'd code: answer it
            record_error(f"server {method} {url.path}", exc)
            failed = ProbeError(f"the probe failed internally ({type(exc).__name__}: {exc}); see probe.errors.")
            self._send(500, failed.to_dict())

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")


def send_buffers(sock: socket.socket, buffers: list) -> None:
    """Send every buffer, gathered into as few ``sendmsg`` calls as the kernel allows (no concatenated copy)."""
    views = [memoryview(b).cast("B") for b in buffers]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + 512])  # IOV_MAX is 1024 on Linux
        while i < len(views) and sent >= views[i].nbytes:
            sent -= views[i].nbytes
            i += 1
        if sent:
            views[i] = views[i][sent:]


def _audit_refusal(handler, method: str, client: dict, exc: AuthError) -> None:
    """Refusals of the action and eval tiers go to the audit log like the actions themselves."""
    entry = ROUTES.get((method, urlparse(handler.path).path))
    if entry is not None and entry.tier != "read":
        audit(
            client, urlparse(handler.path).path.rsplit("/", 1)[-1], {}, "refused", reason=exc.message, tier=entry.tier
        )


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


_WRONG_TOKEN = "missing or wrong token; pass --token or set PROBE_TOKEN to the training process's token."
_served = {"unix": 0, "tcp": 0}
_served_lock = threading.Lock()


def _count_request(transport: str) -> None:
    with _served_lock:
        _served[transport] += 1


def requests_served() -> dict:
    """Requests answered so far by transport (``/health`` shows them: one query costs one request)."""
    with _served_lock:
        return dict(_served)
