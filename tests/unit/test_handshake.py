"""The TCP handshake's rules (``probe.util.handshake``), server and client sides, without a process or a socket."""

from __future__ import annotations

import json

import pytest

from probe import AuthError
from probe.util import handshake

ME = handshake.identity_of(3, "node1", 7341, 100)
KEY = handshake.rank_key("job-token", ME)


def _check(value: str, line: str = "GET /health HTTP/1.1", nonces=None):
    return handshake.check_header(
        value.encode(), line.encode(), key=KEY, token="job-token", identity=ME, nonces=nonces or handshake.Nonces()
    )


def _signed(nonces, line: str = "GET /health", key: str = KEY) -> str:
    nonce = _check(f"Probe-Challenge {handshake.new_nonce()}", nonces=nonces).answer["challenge"]["nonce"]
    return f"Probe-HMAC {nonce} {handshake.request_mac(key, nonce, line)}"


def test_a_request_signed_with_the_ranks_key_opens_it_once():
    nonces = handshake.Nonces()
    signed = _signed(nonces)
    assert _check(signed, nonces=nonces).ok and not _check(signed, nonces=nonces).ok


def test_a_signature_for_another_request_another_rank_or_an_unissued_nonce_is_refused():
    nonces = handshake.Nonces()
    other_rank = handshake.rank_key("job-token", dict(ME, rank=4))
    assert not _check(_signed(nonces, "GET /health"), "POST /eval HTTP/1.1", nonces).ok
    assert not _check(_signed(nonces, key=other_rank), nonces=nonces).ok
    made_up = "x" * 24
    assert not _check(f"Probe-HMAC {made_up} {handshake.request_mac(KEY, made_up, 'GET /health')}", nonces=nonces).ok


def test_a_nonce_expires_and_the_oldest_go_past_the_cap():
    expired = handshake.Nonces(ttl=-1.0)
    assert not _check(_signed(expired), nonces=expired).ok
    small = handshake.Nonces(cap=2)
    first = _signed(small)
    _signed(small), _signed(small)
    assert not _check(first, nonces=small).ok


def test_bearer_takes_the_jobs_token_or_this_ranks_key_only():
    assert _check("Bearer job-token").ok and _check(f"Bearer {KEY}").ok
    assert not _check(f"Bearer {handshake.rank_key('job-token', dict(ME, pid=101))}").ok
    assert not _check("Bearer ").ok and not _check("Probe-Challenge short").ok


class _Target:
    label, host, port = "rank 3", "node1", 7341

    def __init__(self, key=None, token=None, entry=None):
        self.key, self.token, self.entry = key, token, entry


def _server(key: str, identity: dict = ME):
    """``ask`` for client_header: a server holding ``key`` (the requests it saw are kept in ``seen``)."""
    nonces, seen = handshake.Nonces(), []

    def ask(value: str):
        seen.append(value)
        verdict = handshake.check_header(
            value.encode(), b"GET /health HTTP/1.1", key=key, token="-", identity=identity, nonces=nonces
        )
        return 401, json.dumps(verdict.answer or {}).encode()

    return ask, seen


def test_the_client_sends_its_proof_only_to_the_rank_that_holds_the_key():
    entry = {"pid": 100, "rank": 3, "host": "node1", "tcp_port": 7341}
    ask, _ = _server(KEY)
    assert handshake.client_header(_Target(key=KEY, entry=entry), "GET /x", ask).startswith("Probe-HMAC ")
    ask, _ = _server(handshake.rank_key("job-token", ME))  # a typed job token: the rank's key is derived
    assert handshake.client_header(_Target(token="job-token"), "GET /x", ask).startswith("Probe-HMAC ")
    for wrong, target in (
        (handshake.rank_key("other-job", ME), _Target(key=KEY, entry=entry)),  # not that rank's key
        (KEY, _Target(token="wrong")),  # a wrong typed token
    ):
        ask, seen = _server(wrong)
        with pytest.raises(AuthError, match="did not prove"):
            handshake.client_header(target, "GET /x", ask)
        assert len(seen) == 1 and seen[0].startswith("Probe-Challenge ")  # nothing but the nonce went out
    moved = dict(ME, pid=200)  # the port now belongs to another process of this job
    ask, seen = _server(handshake.rank_key("job-token", moved), moved)
    with pytest.raises(AuthError, match="registry names pid 100"):
        handshake.client_header(_Target(key=KEY, token="job-token", entry=entry), "GET /x", ask)
    assert len(seen) == 1
