"""The page's HTTP server: static files and a small JSON API, behind a token in the path.

The checks every request passes are listed in docs/security.md ("The page checks who is asking")
and docs/ui.md: a random token as the first path segment, compared in constant time (relative
links inside the page carry it without any script doing it); ``Host`` and ``Origin`` naming this
server; the CSRF header on every POST; no caching and no other origin (Content-Security-Policy);
at most ``MAX_CONNECTIONS`` connections, one thread each, and ``IDLE_TIMEOUT`` for a silent one.
"""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlparse

from probe._errors import ProbeError
from probe.util.handshake import host_names
from probe.util.slots import BoundedThreads
from probe.util.validate import BadRequest, request_body

from . import api


_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
}
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
MAX_CONNECTIONS = 32  # a browser opens about six; 3000 idle sockets must not become 3000 threads
IDLE_TIMEOUT = 15.0  # seconds a connection may stay silent (keep-alive included)
CSRF_HEADER = "X-Probe-CSRF"
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
    b"Content-Length: 47\r\n\r\nprobe ui: too many connections; retry shortly.\n"
)


def _static_files() -> dict:
    """``{name: bytes}`` of the page's assets, read once from the installed package."""
    root = resources.files("probe.cli.ui") / "static"
    return {f.name: f.read_bytes() for f in root.iterdir() if f.is_file()}


class UIServer(BoundedThreads, ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(self, session, host: str, port: int, allow_actions: bool = False, refresh: float = 3.0):
        self.session = session
        self.token = secrets.token_urlsafe(24)
        self.csrf = secrets.token_urlsafe(24)
        self.allow_actions = allow_actions
        self.refresh = refresh
        self.files = _static_files()
        self.started = time.time()
        self.launch_file: str | None = None  # see open_browser
        self.bound_threads(MAX_CONNECTIONS)
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)
        self.hosts = frozenset(host_names(host, self.server_address[0], self.port))

    def busy_reply(self) -> bytes:
        """What a connection past MAX_CONNECTIONS is sent (``BoundedThreads``) before it is closed."""
        return _BUSY

    def open_browser(self, url: str) -> str:
        """Open ``url`` in this machine's browser without putting it on any command line (``ps`` shows those to
        every user): the browser is given a 0600 file in a private directory that redirects to the URL. The
        file goes once the page has been loaded, or when the server stops. Returns the file's path."""
        import html as _html
        import os
        import tempfile
        import webbrowser

        folder = tempfile.mkdtemp(prefix="probe-ui-")  # 0700, ours
        path = os.path.join(folder, "open.html")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            quoted = _html.escape(url, quote=True)
            f.write(
                f'<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" content="0; url={quoted}">'
                f'<title>probe ui</title><a href="{quoted}">probe ui</a>\n'
            )
        self.launch_file = path
        webbrowser.open("file://" + path)
        return path

    def forget_launch_file(self) -> None:
        import os
        import shutil

        path, self.launch_file = self.launch_file, None
        if path:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def url(self, host: str) -> str:
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.port}/{self.token}/"

    def config(self) -> dict:
        a = self.session.args
        target = a.endpoint or (f"--rank {a.rank}" if a.rank is not None else f"--ranks {a.ranks}" if a.ranks else "")
        return {
            "target": target,
            "multi": self.session.multi,
            "allow_actions": self.allow_actions,
            "csrf": self.csrf,
            "actions": {k: list(v) for k, v in api.ACTIONS.items()} if self.allow_actions else {},
            "refresh": self.refresh,
        }

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, name="probe-ui", daemon=True)
        t.start()
        return t


class _Handler(BaseHTTPRequestHandler):
    server: UIServer
    protocol_version = "HTTP/1.1"
    server_version = "probe-ui"
    sys_version = ""
    timeout = IDLE_TIMEOUT

    def log_message(self, format, *args):  # the terminal shows the URL, not every request
        pass

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Referrer-Policy", "no-referrer")
            self.send_header("Content-Security-Policy", _CSP)
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True

    def _json(self, status: int, doc) -> None:
        self._send(status, json.dumps(doc, default=str, allow_nan=False).encode(), "application/json")

    def _refused(self) -> str | None:
        """Why this request is refused before its token is even looked at (DNS rebinding, another origin)."""
        host = (self.headers.get("Host") or "").strip().lower()
        if host not in self.server.hosts:
            return "this page answers only under the address `probe ui` printed (Host header refused)"
        origin = self.headers.get("Origin")
        if origin is not None and origin.strip().lower() not in {f"http://{h}" for h in self.server.hosts}:
            return "requests from another origin are refused"
        return None

    def _route(self, method: str) -> None:
        why = self._refused()
        if why is not None:
            self.close_connection = True
            self._send(403, f"forbidden: {why}.\n".encode(), "text/plain; charset=utf-8")
            return
        url = urlparse(self.path)
        token, _, rest = url.path.lstrip("/").partition("/")
        if not hmac.compare_digest(token.encode(), self.server.token.encode()):
            self._send(
                403,
                b"forbidden: this page needs the URL with the token that `probe ui` printed\n",
                "text/plain; charset=utf-8",
            )
            return
        if method == "GET" and url.path == "/" + token:  # the URL without its last slash: relative links need it
            try:
                self.send_response(301)
                self.send_header("Location", f"/{token}/")
                self.send_header("Content-Length", "0")
                self.end_headers()
            except OSError:
                self.close_connection = True
            return
        if method == "GET" and not rest.startswith("api/"):
            name = rest or "index.html"
            body = self.server.files.get(name)
            if body is None:
                self._send(404, b"not found\n", "text/plain; charset=utf-8")
                return
            self._send(200, body, _TYPES.get(name[name.rfind(".") :], "application/octet-stream"))
            if name == "index.html" and self.server.launch_file:
                self.server.forget_launch_file()  # the browser got here: the file that brought it is not needed
            return
        params = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if method == "POST":
            given = (self.headers.get(CSRF_HEADER) or "").encode()
            if not hmac.compare_digest(given, self.server.csrf.encode()):
                self._json(403, {"error": f"this request lacks the page's {CSRF_HEADER} header; reload the page."})
                return
            try:
                params.update(request_body(self.headers.get("Content-Length"), self.rfile))
            except BadRequest:  # not JSON, not an object, too deep or too long
                self.close_connection = True  # (a body left unread must not be taken for the next request)
                self._json(400, {"error": "the request body must be a JSON object under 1 MiB."})
                return
        handler = _API.get((method, rest))
        if handler is None:
            self._json(404, {"error": f"no such API {method} /{rest}."})
            return
        try:
            self._json(200, handler(self.server, params))
        except BadRequest as exc:  # a parameter the page would never send: one sentence, 400
            self._json(400, {"error": exc.message})
        except ProbeError as exc:  # the probe's own refusals are answers, shown in the panel (not HTTP errors)
            self._json(200, {"error": exc.message, "kind": exc.kind})
        except Exception as exc:  # a bug of ours: show it on the page and in the terminal, keep serving
            import traceback

            sys.stderr.write(f"probe ui: internal error answering {method} /{rest}:\n{traceback.format_exc()}")
            self._json(500, {"error": f"probe ui failed internally ({type(exc).__name__}: {exc})."})

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")


MAX_ROWS = 1_000_000


def _number(p: dict, name: str, default, kind, low, high):
    """``p[name]`` as a ``kind`` (int or float) in [low, high], ``default`` when absent; else BadRequest.

    >>> _number({"max_rows": "abc"}, "max_rows", 2000, int, 1, MAX_ROWS)
    Traceback (most recent call last):
    ...
    probe.util.validate.BadRequest: max_rows must be a whole number from 1 to 1,000,000, not 'abc'.
    """
    value = p.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
    if kind is int:
        ok = ok and value == int(value)
    if not ok:
        what = "a whole number" if kind is int else "a number of seconds"
        raise BadRequest(f"{name} must be {what} from {low:,} to {high:,}, not {value!r}.")
    return kind(value)


def _query(srv: UIServer, p: dict):
    sql = p.get("sql")
    if not isinstance(sql, str) or not sql.strip():
        raise ProbeError("no SQL given; type a query such as SELECT * FROM torch.steps.")
    max_rows = _number(p, "max_rows", 2000, int, 1, MAX_ROWS)
    return api.query_doc(srv.session, sql, max_rows=max_rows)


def _profile(srv: UIServer, p: dict):
    from ..commands.profile import MAX_SECONDS

    seconds = _number(p, "seconds", 3.0, float, 0, MAX_SECONDS)
    return api.profile_doc(srv.session, seconds, native=bool(p.get("native")))


def _action(srv: UIServer, p: dict):
    if not srv.allow_actions:
        raise ProbeError("actions are off on this page; start it with `probe ui --allow-actions` or use the CLI.")
    if p.get("confirmed") is not True:
        raise ProbeError("an action needs a confirmation on the page.")
    params = p.get("params") or {}
    if not isinstance(params, dict) or not isinstance(p.get("name"), str):
        raise BadRequest("an action is a name and an object of parameters.")
    return api.action_doc(srv.session, p["name"], params)


_API = {
    ("GET", "api/config"): lambda srv, p: srv.config(),
    ("GET", "api/tables"): lambda srv, p: api.tables_doc(srv.session),
    ("GET", "api/job"): lambda srv, p: api.job_doc(srv.session),
    ("GET", "api/stacks"): lambda srv, p: api.stacks_doc(srv.session),
    ("GET", "api/findings"): lambda srv, p: api.findings_doc(srv.session),
    ("POST", "api/query"): _query,
    ("POST", "api/profile"): _profile,
    ("POST", "api/action"): _action,
}
