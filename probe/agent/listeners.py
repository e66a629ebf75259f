"""The probe's listeners: a unix socket (same user only: a 0700 directory and the peer's uid checked) and, when
asked, TCP behind a per-rank key (``probe.util.handshake``); each with its own connection bound and read timeout
(``server`` handles requests).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import struct
import threading

from ..config import setting
from .._errors import AuthError
from ..util import handshake
from ..util.errorlog import record_error
from ..util.slots import BoundedThreads
from .server import _WRONG_TOKEN, _Handler


_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)


class _Base(BoundedThreads, socketserver.ThreadingMixIn):
    daemon_threads = True
    block_on_close = False
    # socketserver's default backlog is 5; a unix socket refuses with EAGAIN (instead of
    # queueing) once it is full, so a burst of clients (`--ranks all` fan-outs, watch loops)
    # would see spurious failures.
    request_queue_size = 128

    def _limits(self) -> None:
        self.read_timeout = setting("PROBE_READ_TIMEOUT")
        self.max_connections = setting("PROBE_MAX_CONNECTIONS")
        self.bound_threads(self.max_connections)

    def busy_reply(self) -> bytes:
        """What a connection past ``max_connections`` is sent (``BoundedThreads``) before it is closed."""
        body = json.dumps(
            {
                "error": f"the probe serves {self.max_connections} connections at once and all are busy; "
                "retry in a moment (PROBE_MAX_CONNECTIONS raises the limit).",
                "kind": "busy",
                "exit_code": 3,
            }
        ).encode()
        return _BUSY % (len(body), body)

    def handle_error(self, request, client_address):
        record_error("server connection")


class UnixServer(_Base, socketserver.UnixStreamServer):
    """Same-user clients only: the directory is 0700 and the peer uid is checked."""

    transport = "unix"

    def __init__(self, path: str):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._limits()
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
    """Every request must be authenticated (``probe.util.handshake``): with this rank's key, derived from the job's
    token and the rank's identity, after the server proved it holds it; or with the token itself (``Bearer``)."""

    transport = "tcp"
    allow_reuse_address = True

    def __init__(self, host: str, port: int, token: str, rank: int | None = None):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._limits()
        super().__init__((host, port), _Handler)
        self.identity = handshake.identity_of(rank, socket.gethostname(), self.server_address[1], os.getpid())
        self.token = token
        self.key = handshake.rank_key(token, self.identity)  # what the registry entry holds: this rank's only
        self.nonces = handshake.Nonces()

    def authorize(self, value: bytes, request_line: bytes) -> handshake.Verdict:
        """What an Authorization header's value is worth for the request on ``request_line`` (constant time)."""
        return handshake.check_header(
            value, request_line, key=self.key, token=self.token, identity=self.identity, nonces=self.nonces
        )

    def client_info(self, handler) -> dict:
        if not getattr(handler, "authorized", False):  # read_head checks the header as soon as it arrives
            raise AuthError(_WRONG_TOKEN)
        host, port = handler.client_address[:2]
        return {"transport": "tcp", "address": f"{host}:{port}"}

    def describe_client(self, handler) -> str:
        return str(handler.client_address[0])


def serve_in_thread(server, name: str) -> threading.Thread:
    """Serve on a daemon thread until ``stop_serving``."""
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 3600}, name=name, daemon=True)
    t.start()
    return t


def close(server) -> None:
    """Close the listening socket; a unix socket's file goes with it."""
    try:
        server.server_close()
        if isinstance(server.server_address, str):
            os.unlink(server.server_address)
    except OSError:
        pass


def stop_serving(server, thread: threading.Thread) -> None:
    """End ``serve_forever``, which sleeps in select with a long timeout (no idle wake-ups): ask for the shutdown,
    wake the select by shutting the listening socket down (its accept then fails and is ignored), wait for it."""
    t = threading.Thread(target=server.shutdown, name="probe-server-shutdown", daemon=True)
    t.start()
    with contextlib.suppress(OSError):
        server.socket.shutdown(socket.SHUT_RDWR)
    t.join(2)
    if thread is not threading.current_thread():
        thread.join(2)
