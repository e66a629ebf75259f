"""Proof of who listens at a TCP endpoint before anything secret is sent to it, and per-rank keys.

A rank's key is derived from the job's token and the rank's identity, so holding one rank's
key (its registry entry) opens no other rank::

    job key  = PBKDF2-SHA256(token, "probe job key", 100000)   (a guessed token costs that much offline)
    rank key = HMAC(job key, "probe rank key|RANK|HOST|PORT|PID")

The registry entry holds the rank key only. One TCP request takes two connections:

1. ``Authorization: Probe-Challenge CNONCE`` (a fresh random nonce, nothing secret): the server
   answers 401 with its identity, a single-use server nonce SNONCE and
   ``proof = HMAC(rank key, "probe proof|CNONCE|SNONCE|identity")``.
2. The client checks the identity (the registry entry's, when it came from one) and the proof,
   in constant time, with the key it holds (the entry's, or one derived from a token the person
   typed); only then ``Authorization: Probe-HMAC SNONCE MAC`` with
   ``MAC = HMAC(rank key, "probe request|SNONCE|METHOD TARGET")``. The server takes each of its
   nonces once, within ``NONCE_TTL`` seconds, and keeps at most ``MAX_NONCES``.

``Bearer TOKEN`` (the job's token or the rank's key, as a script or curl sends it) is still
accepted by the server; the probe CLI never sends it. Primitives from the standard library only.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
import secrets
import socket
import threading
import time
from collections import OrderedDict


NONCE_TTL = 30.0  # seconds a server nonce may wait for its request
MAX_NONCES = 1024  # server nonces kept at once (the oldest go first)
_ITERATIONS = 100_000
_NONCE = re.compile(r"[A-Za-z0-9_-]{16,64}")
_HEX = re.compile(r"[0-9a-f]{64}")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback, reachable from no other host."""
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def host_names(host: str, bound: str, port: int | None = None) -> list[str]:
    """The ``Host`` header values a front end's server (``probe ui``, ``probe mcp --http``) answers to, against DNS
    rebinding: the loopback names, then the address it was asked for and bound to (this host's names for a
    wildcard), IPv6 ones in brackets; with ``port``, each with it (and without it on port 80).

    >>> sorted(host_names("127.0.0.1", "127.0.0.1", 8000))
    ['127.0.0.1:8000', '[::1]:8000', 'localhost:8000']
    """
    names = list(LOOPBACK_NAMES)
    for h in (socket.gethostname(), socket.getfqdn()) if bound in ("0.0.0.0", "::") else (host, bound):
        h = f"[{h}]" if ":" in h else h
        if h not in names:
            names.append(h)
    return names if port is None else [f"{n}:{port}" for n in names] + (names if port == 80 else [])


def _mac(key: str, text: str) -> str:
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()


@functools.lru_cache(maxsize=8)
def _job_key(token: str) -> str:
    return hashlib.pbkdf2_hmac("sha256", token.encode(), b"probe job key", _ITERATIONS).hex()


def _identity_text(identity: dict) -> str:
    rank = identity.get("rank")
    return f"{'' if rank is None else int(rank)}|{identity['host']}|{int(identity['port'])}|{int(identity['pid'])}"


def identity_of(rank, host: str, port: int, pid: int) -> dict:
    """What a rank proves it is: its rank (None outside a job), host name, TCP port and pid."""
    return {"rank": rank, "host": host, "port": int(port), "pid": int(pid)}


def rank_key(token: str, identity: dict) -> str:
    """The key of the rank ``identity`` in the job whose token is ``token`` (64 hex digits).

    >>> one = identity_of(0, "node1", 7341, 100)
    >>> rank_key("t", one) == rank_key("t", one) != rank_key("t", dict(one, rank=1))
    True
    """
    return _mac(_job_key(token), "probe rank key|" + _identity_text(identity))


def new_nonce() -> str:
    return secrets.token_urlsafe(18)


def proof(key: str, cnonce: str, snonce: str, identity: dict) -> str:
    return _mac(key, f"probe proof|{cnonce}|{snonce}|{_identity_text(identity)}")


def request_mac(key: str, snonce: str, request_line: str) -> str:
    """The MAC of one request: ``request_line`` is its method and target (``GET /health?x=1``)."""
    return _mac(key, f"probe request|{snonce}|{request_line}")


def challenge_answer(key: str, identity: dict, cnonce: str, snonce: str) -> dict:
    """The 401 body a server (or a test's stand-in that holds ``key``) answers a challenge with."""
    return {
        "error": "this endpoint proves it holds the rank's key before a client sends anything secret.",
        "kind": "auth",
        "exit_code": 4,
        "challenge": dict(identity, nonce=snonce, proof=proof(key, cnonce, snonce, identity)),
    }


class Nonces:
    """The server's nonces: each taken at most once, within ``NONCE_TTL`` seconds; at most ``MAX_NONCES`` kept."""

    def __init__(self, ttl: float = NONCE_TTL, cap: int = MAX_NONCES):
        self.ttl, self.cap = ttl, cap
        self._issued: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def issue(self) -> str:
        nonce, now = new_nonce(), time.monotonic()
        with self._lock:
            while self._issued and (len(self._issued) >= self.cap or next(iter(self._issued.values())) < now):
                self._issued.popitem(last=False)
            self._issued[nonce] = now + self.ttl
        return nonce

    def take(self, nonce: str) -> bool:
        with self._lock:
            expires = self._issued.pop(nonce, None)
        return expires is not None and expires >= time.monotonic()


class Verdict:
    """What a server makes of an ``Authorization`` value: ``ok``, or ``answer`` (a challenge's 401 body)."""

    def __init__(self, ok: bool = False, answer: dict | None = None):
        self.ok, self.answer = ok, answer


def check_header(value: bytes, request_line: bytes, *, key: str, token: str, identity: dict, nonces: Nonces) -> Verdict:
    """The server's side: whether ``value`` (an Authorization header's) opens this rank for ``request_line``."""
    scheme, _, rest = value.strip().partition(b" ")
    scheme, rest = scheme.lower(), rest.strip()
    if scheme == b"bearer":
        return Verdict(hmac.compare_digest(rest, token.encode()) | hmac.compare_digest(rest, key.encode()))
    try:
        words = rest.decode("ascii").split()
        line = request_line.decode("ascii").split()
    except UnicodeDecodeError:
        return Verdict()
    if scheme == b"probe-challenge" and len(words) == 1 and _NONCE.fullmatch(words[0]):
        return Verdict(answer=challenge_answer(key, identity, words[0], nonces.issue()))
    if scheme == b"probe-hmac" and len(words) == 2 and len(line) >= 2 and _NONCE.fullmatch(words[0]):
        if not nonces.take(words[0]):
            return Verdict()
        expected = request_mac(key, words[0], f"{line[0]} {line[1]}")
        return Verdict(hmac.compare_digest(words[1].encode(), expected.encode()))
    return Verdict()


def _challenge(status: int, body: bytes) -> dict | None:
    """The challenge of a 401 answer when it has the shape this module sends, else None."""
    import json

    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    c = doc.get("challenge") if isinstance(doc, dict) and status == 401 else None
    if not isinstance(c, dict):
        return None
    ok = (
        (c.get("rank") is None or type(c.get("rank")) is int)
        and isinstance(c.get("host"), str)
        and all(type(c.get(k)) is int for k in ("port", "pid"))
        and isinstance(c.get("nonce"), str)
        and _NONCE.fullmatch(c["nonce"])
        and isinstance(c.get("proof"), str)
        and _HEX.fullmatch(c["proof"])
    )
    return c if ok else None


def client_header(target, request_line: str, ask) -> str:
    """The client's side: the ``Authorization`` value for one request to ``target`` (``cli.plumbing``'s Target),
    once its endpoint has proved it holds the rank's key; nothing secret goes out before.

    ``ask(value)`` sends a request carrying ``Authorization: value`` and returns ``(status, body)``.
    ``target.key`` is a rank key from a registry entry (``target.entry`` names the rank that must
    answer); ``target.token`` one the person typed (a job token, or a rank key itself).
    """
    from probe._errors import AuthError, EndpointError

    where = f"{target.label}" + ("" if ":" in target.label else f" at {target.host}:{target.port}")
    nothing = "nothing secret was sent to it"
    cnonce = new_nonce()
    c = _challenge(*ask(f"Probe-Challenge {cnonce}"))
    if c is None:
        raise EndpointError(
            f"{where} did not answer like a probe of this version (no proof that it holds the rank's key); "
            f"{nothing}: check the endpoint, or restart the job with this version of probe."
        )
    identity = identity_of(c["rank"], c["host"], c["port"], c["pid"])
    e = target.entry or {}
    if e.get("pid") is not None and e.get("tcp_port") is not None:
        named = identity_of(e.get("rank"), e.get("host"), e["tcp_port"], e["pid"])
        if named != identity:
            raise AuthError(
                f"{where} did not prove it is that rank: it says it is pid {c['pid']} on {c['host'][:64]!r} "
                f"(port {c['port']}), the registry names pid {e['pid']} on {e.get('host')!r} (port {e['tcp_port']}); "
                f"that process has probably exited and another program took its port ({nothing})."
            )
    keys = [k for k in (target.key,) if k]
    if target.token:
        keys += [rank_key(target.token, identity), target.token]
    if not keys:
        raise AuthError(f"{target.label} listens on TCP and needs a token; pass --token or set PROBE_TOKEN.")
    for key in keys:
        if hmac.compare_digest(proof(key, cnonce, c["nonce"], identity).encode(), c["proof"].encode()):
            return f"Probe-HMAC {c['nonce']} {request_mac(key, c['nonce'], request_line)}"
    if target.token and not target.key:
        raise AuthError(
            f"{where} did not prove it holds the key of the token given: either a wrong token (pass the job's "
            f"token with --token or PROBE_TOKEN) or not a probe of that job; {nothing}."
        )
    raise AuthError(
        f"{where} did not prove it is that rank (its proof does not match the registry's key): its process has "
        f"probably exited and another program took its port; {nothing}."
    )
