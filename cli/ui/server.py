"""The page's HTTP server: static files and a small JSON API, behind a token in the path.

Every URL starts with ``/<token>/``; anything else is answered 403. The token is random
per run (``secrets.token_urlsafe``) and compared in constant time, so another user on the
host who finds the loopback port still cannot read the page. Relative links inside the
page carry the token without any script doing it. Responses forbid caching and, through
a Content-Security-Policy, any request to another origin: the page works offline and
cannot leak to a CDN.
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

from . import api

__all__ = ["UIServer"]

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".txt": "text/plain; charset=utf-8"}
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
MAX_BODY = 1 << 20


def _static_files() -> dict:
    """``{name: bytes}`` of the page's assets, read once from the installed package."""
    root = resources.files("probe.cli.ui") / "static"
    return {f.name: f.read_bytes() for f in root.iterdir() if f.is_file()}


class UIServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, session, host: str, port: int, allow_actions: bool = False, refresh: float = 3.0):
        self.session = session
        self.token = secrets.token_urlsafe(24)
        self.allow_actions = allow_actions
        self.refresh = refresh
        self.files = _static_files()
        self.started = time.time()
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def url(self, host: str) -> str:
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.port}/{self.token}/"

    def config(self) -> dict:
        a = self.session.args
        target = a.endpoint or (f"--rank {a.rank}" if a.rank is not None else f"--ranks {a.ranks}" if a.ranks else "")
        return {"target": target, "multi": self.session.multi, "allow_actions": self.allow_actions,
                "actions": {k: list(v) for k, v in api.ACTIONS.items()} if self.allow_actions else {},
                "refresh": self.refresh}

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, name="probe-ui", daemon=True)
        t.start()
        return t


class _Handler(BaseHTTPRequestHandler):
    server: UIServer
    protocol_version = "HTTP/1.1"
    server_version = "probe-ui"
    sys_version = ""

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

    def _route(self, method: str) -> None:
        url = urlparse(self.path)
        token, _, rest = url.path.lstrip("/").partition("/")
        if not hmac.compare_digest(token.encode(), self.server.token.encode()):
            self._send(403, b"forbidden: this page needs the URL with the token that `probe ui` printed\n",
                       "text/plain; charset=utf-8")
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
            self._send(200, body, _TYPES.get(name[name.rfind("."):], "application/octet-stream"))
            return
        params = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if method == "POST":
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    raise ValueError
                params.update(json.loads(self.rfile.read(length) or b"{}"))
            except ValueError:
                self._json(400, {"error": "the request body must be a JSON object under 1 MiB."})
                return
        handler = _API.get((method, rest))
        if handler is None:
            self._json(404, {"error": f"no such API {method} /{rest}."})
            return
        try:
            self._json(200, handler(self.server, params))
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


def _query(srv: UIServer, p: dict):
    sql = p.get("sql")
    if not isinstance(sql, str) or not sql.strip():
        raise ProbeError("no SQL given; type a query such as SELECT * FROM torch.steps.")
    max_rows = p.get("max_rows")
    return api.query_doc(srv.session, sql, max_rows=int(max_rows) if max_rows else 2000)


def _profile(srv: UIServer, p: dict):
    try:
        seconds = float(p.get("seconds", 3))
    except (TypeError, ValueError):
        raise ProbeError("seconds must be a number.") from None
    return api.profile_doc(srv.session, seconds, native=bool(p.get("native")))


def _action(srv: UIServer, p: dict):
    if not srv.allow_actions:
        raise ProbeError("actions are off on this page; start it with `probe ui --allow-actions` or use the CLI.")
    if p.get("confirmed") is not True:
        raise ProbeError("an action needs a confirmation on the page.")
    return api.action_doc(srv.session, str(p.get("name")), p.get("params") or {})


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
