"""A small HTTP/1.1 JSON client for probe servers over a unix socket or TCP.

It speaks just enough HTTP for our own server, which always answers with
``Connection: close``: send one request, read to end of stream, split head from body.
(``http.client`` would cost the CLI ~12 ms of imports, mostly the ``email`` package,
on every ``probe PID backtrace``.)
"""

from __future__ import annotations

import json
import socket
import time

from probe._errors import AuthError, EndpointError, error_from_dict

from .endpoint import Target


AGENT_HEADER = "X-Probe-Agent"  # names the program acting for the user; recorded in the audit log and probe.actions


class _BadResponse(Exception):
    pass


class _TooLarge(Exception):
    pass


# The most an answer may hold, head included: a JSON answer (the largest are a backtrace of thousands of threads,
# a profile's stacks, a 4 MiB profile-steps chunk in base64), and a snapshot, which the training process keeps under
# its PROBE_SNAPSHOT_BYTES; a larger answer is not a probe's, and reading it would only grow this process.
MAX_JSON_ANSWER = 32 * 1024 * 1024
SNAPSHOT_ANSWER_FACTOR = 4  # times this shell's PROBE_SNAPSHOT_BYTES
GRACE_S = 1.0  # beyond a request's timeout, for the server's own refusal at that timeout to arrive


# What each answer must hold before any command reads it: the endpoint may not be ours (a typo'd port, a
# hostile listener), and its `{}` must give a sentence, not a KeyError. (key, type) pairs, checked one level
# deep; /tables' names and types are checked against the allow-list too, since they reach SQL here.
_SHAPES = {
    "/tables": (("tables", list),),
    "/backtrace": (("threads", list),),
    "/profile": (("stacks", list),),
    "/actions/wait": (("action", dict),),
    "/profile-steps": (("profile", dict),),
    "/profile-steps?offset": (("data", str),),  # a chunk of the trace file (?file=...&offset=N)
}


def _redact_locals(doc: dict) -> None:
    """Frame locals through the same redaction as the server's (an older server, or one not ours, may not have)."""
    for thread in doc["threads"]:
        for frame in (thread.get("frames") or []) if isinstance(thread, dict) else []:
            if isinstance(frame, dict) and isinstance(frame.get("locals"), dict):
                from probe.util.printable import (
                    redact,
                )  # only with --locals: its patterns cost a plain backtrace's start-up

                frame["locals"] = {
                    str(k): redact(str(k), v if isinstance(v, str) else str(v)) for k, v in frame["locals"].items()
                }


def check_answer(path: str, doc: dict) -> str | None:
    """Why ``doc`` is not what ``path`` answers, or None when it is.

    >>> check_answer("/tables", {})
    "its /tables answer has no 'tables' list"
    >>> table = {"name": "t.x", "kind": "ring", "description": "", "columns": [{"name": "a", "type": "INT); DROP"}]}
    >>> print(check_answer("/tables", {"tables": [table]}))  # doctest: +NORMALIZE_WHITESPACE
    its table t.x: column a of t.x declares type 'INT); DROP', which is not one of BIGINT, INTEGER, DOUBLE, VARCHAR,
    BOOLEAN, TIMESTAMP
    >>> check_answer("/profile-steps?file=/x&offset=0", {"data": "", "next": None}) is None
    True
    """
    route, _, query = path.partition("?")
    chunk = "offset=" in query and _SHAPES.get(route + "?offset")
    for key, typ in chunk or _SHAPES.get(route, ()):
        if not isinstance(doc.get(key), typ):
            return f"its {route} answer has no {key!r} {typ.__name__}"
    if route == "/tables":
        from probe.util.wire import WireError, check_table

        for t in doc["tables"]:
            try:
                if not isinstance(t, dict) or not isinstance(t.get("columns"), list):
                    raise WireError("a table without a list of columns")
                check_table(
                    t.get("name"),
                    [(c.get("name"), c.get("type")) if isinstance(c, dict) else (None, None) for c in t["columns"]],
                )
            except WireError as exc:
                name = t.get("name") if isinstance(t, dict) and isinstance(t.get("name"), str) else "?"
                return f"its table {name[:80]}: {exc}"
    return None


def _exchange(
    sock: socket.socket, method: str, path: str, headers: dict, body: bytes | None, deadline: float, limit: int
) -> tuple[int, bytearray]:
    """Send one request on a connected socket; return (status, body).

    The whole exchange ends by ``deadline`` (time.monotonic), however the server paces its bytes, and reads
    at most ``limit`` bytes: ``socket.timeout`` and ``_TooLarge`` otherwise."""

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout()
        return remaining

    lines = [f"{method} {path} HTTP/1.1", "Host: probe"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"Content-Length: {len(body or b'')}")
    sock.settimeout(left())
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
    data = bytearray()
    while True:
        sock.settimeout(left())
        chunk = sock.recv(262144)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise _TooLarge()
    end = data.find(b"\r\n\r\n")
    status_line = data[: max(end, 0)].split(b"\r\n", 1)[0].split()
    if end < 0 or len(status_line) < 2 or not status_line[0].startswith(b"HTTP/") or not status_line[1].isdigit():
        raise _BadResponse()
    del data[: end + 4]  # in place: a snapshot is not copied again
    return int(status_line[1]), data


def _error_from_answer(label: str, status: int, doc):
    """The ProbeError an error answer stands for; an error answer not shaped like a probe's is an EndpointError."""
    exit_code = doc.get("exit_code") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("error"), str)
        or not isinstance(doc.get("kind", ""), str)
        or not (exit_code is None or (type(exit_code) is int and 1 <= exit_code <= 125))  # never 0: no false success
    ):
        return EndpointError(
            f"{label} did not answer like a probe (a malformed HTTP {status} error); check the endpoint."
        )
    if status == 401:
        return AuthError(doc["error"])
    return error_from_dict(doc)


def _snapshot_answer_limit() -> int:
    from probe.config import setting

    return SNAPSHOT_ANSWER_FACTOR * setting("PROBE_SNAPSHOT_BYTES", strict=True) + (1 << 20)  # + its header


class Client:
    def __init__(self, target: Target, timeout: float = 10.0, agent: str | None = None):
        self.target = target
        self.timeout = timeout
        self.agent = agent  # who drives this client on a person's behalf (e.g. "mcp"); the server audits it

    def _connect(self, timeout: float) -> socket.socket:
        t = self.target
        if t.entry.get("missing"):
            raise EndpointError(t.entry.get("hint", f"{t.label} has no probe server."))
        if t.socket:
            import errno

            deadline = time.monotonic() + min(timeout, 2.0)
            delay = 0.005
            while True:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    sock.connect(t.socket)
                    return sock
                except BlockingIOError as exc:  # the listen backlog is full: a burst of clients
                    sock.close()
                    if exc.errno != errno.EAGAIN or time.monotonic() > deadline:
                        raise
                    time.sleep(delay)
                    delay = min(delay * 2, 0.1)
                except BaseException:
                    sock.close()
                    raise
        return socket.create_connection((t.host, t.port), timeout=timeout)

    def _proven(self, request_line: str, deadline: float) -> str:
        """The Authorization value of one TCP request, once the endpoint has proved it holds the rank's key (a
        challenge on a connection of its own, within the request's ``deadline``, ``probe.util.handshake``):
        nothing secret goes out before."""
        from probe.util.handshake import client_header

        def ask(value: str) -> tuple[int, bytes]:
            sock = self._connect(max(deadline - time.monotonic(), 0.001))
            try:
                head = {"Authorization": value, "Connection": "close"}
                return _exchange(sock, "GET", "/health", head, None, deadline, MAX_JSON_ANSWER)
            finally:
                sock.close()

        return client_header(self.target, request_line, ask)

    def request(
        self, method: str, path: str, body: dict | None = None, timeout: float | None = None, raw: bool = False
    ):
        """The answer as a dict; with ``raw``, a successful answer's body as bytes (binary routes)."""
        timeout = self.timeout if timeout is None else timeout
        t = self.target
        headers = {"Content-Type": "application/json", "Connection": "close"}
        if self.agent:
            headers[AGENT_HEADER] = self.agent
        tcp = t.port is not None and not t.socket
        if tcp and not (t.token or t.key):
            raise AuthError(f"{t.label} listens on TCP and needs a token; pass --token or set PROBE_TOKEN.")
        payload = json.dumps(body).encode() if body is not None else None
        deadline = time.monotonic() + timeout + GRACE_S  # the whole request, however slowly the answer comes
        limit = _snapshot_answer_limit() if raw else MAX_JSON_ANSWER
        sock = None
        try:
            if tcp:
                headers["Authorization"] = self._proven(f"{method} {path}", deadline)
            sock = self._connect(timeout)
            status, data = _exchange(sock, method, path, headers, payload, deadline, limit)
        except FileNotFoundError:
            raise EndpointError(
                f"the socket of {t.label} is gone; the process probably exited (`probe list` shows live ones)."
            ) from None
        except ConnectionRefusedError:
            where = t.socket or f"{t.host}:{t.port}"
            raise EndpointError(
                f"connection refused by {where}; the probe is not listening there (check the port, or `probe list`)."
            ) from None
        except socket.timeout:
            pid = t.local_pid
            raise EndpointError(
                f"{t.label} did not answer within {timeout:g} s; it may be hung with the GIL held "
                + (
                    f"(try `probe {pid} backtrace`, which falls back to py-spy, or raise --timeout)."
                    if pid
                    else "(on its host, `probe PID backtrace` falls back to py-spy; or raise --timeout)."
                )
            ) from None
        except _BadResponse:
            raise EndpointError(f"{t.label} did not answer like a probe (not HTTP); check the endpoint.") from None
        except _TooLarge:
            raise EndpointError(
                f"{t.label} sent an answer larger than {limit >> 20} MiB, more than a probe sends"
                + (
                    f" ({SNAPSHOT_ANSWER_FACTOR} times PROBE_SNAPSHOT_BYTES; if the job's is larger, set the same here)"
                    if raw
                    else ""
                )
                + "; check the endpoint."
            ) from None
        except OSError as exc:
            raise EndpointError(f"could not talk to {t.label} ({exc}); check the endpoint with `probe list`.") from None
        finally:
            if sock is not None:
                sock.close()
        if raw and status == 200:
            return data
        try:
            doc = json.loads(data or b"{}")
        except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than Python's stack
            raise EndpointError(f"{t.label} did not answer like a probe (HTTP {status}); check the endpoint.") from None
        if status >= 400 or (isinstance(doc, dict) and "error" in doc and "kind" in doc):
            raise _error_from_answer(t.label, status, doc)
        if not isinstance(doc, dict):
            raise EndpointError(f"{t.label} did not answer like a probe (not a JSON object); check the endpoint.")
        why = check_answer(path, doc)
        if why is not None:
            raise EndpointError(f"{t.label} did not answer like a probe ({why}); check the endpoint.")
        if path.startswith("/backtrace"):
            _redact_locals(doc)
        return doc

    def get(self, path: str, timeout: float | None = None, **params) -> dict:
        from urllib.parse import urlencode

        query = urlencode({k: v for k, v in params.items() if v is not None})
        return self.request("GET", f"{path}?{query}" if query else path, timeout=timeout)

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        return self.request("POST", path, body, timeout=timeout)

    def snapshot(self, tables: dict, timeout: float) -> dict:
        """The decoded snapshot of ``tables`` (``{name: {"columns": [...], "filter": ...}}``); see
        ``probe.util.wire``."""
        from probe.util.wire import WireError, decode

        data = self.request("POST", "/snapshot", {"tables": tables, "timeout": timeout}, timeout=timeout, raw=True)
        try:
            return decode(data)
        except WireError as exc:
            if data[:1] == b"{":
                raise EndpointError(
                    f"{self.target.label} answers an older protocol; restart it with this version of probe."
                ) from None
            raise EndpointError(
                f"{self.target.label} sent a snapshot that is damaged or not a probe's ({exc}); "
                "check the endpoint, or retry."
            ) from None
