"""Requests no client of ours sends cannot hurt the training process or let anyone in: bad values and bodies, too many
connections, a token sent to another address, snapshots asked faster than their share of the process allows; and
the process never imports the SQL engine a query could reach.

Each test drives probe's agent with the real CLI, or with a raw socket for what the CLI would never send: served
from the test's own process (``served``) where only its routes and limits are at stake, in a probed process of its
own (``agent``) where the test is about what that process imports."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from harness import exchange, post, serving


def _eval(cli, pid, code: str) -> str:
    r = cli(pid, "eval", code)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_the_training_process_never_imports_duckdb(agent, cli):
    # given a probed process that answered several queries, a join and an aggregate among them
    target = agent()
    for sql in (
        "SELECT count(*) FROM python.threads",
        "SELECT t.name, count(*) FROM python.threads t "
        "JOIN python.backtrace b ON b.thread_id = t.thread_id GROUP BY ALL",
        "SELECT name FROM probe.tables WHERE name LIKE 'python.%'",
    ):
        r = cli(target.pid, "query", sql, "-f", "json")
        assert r.returncode == 0, r.stderr
    # then neither DuckDB nor the SQL parser was ever loaded there
    out = _eval(cli, target.pid, "import sys; print(sorted(m for m in ('duckdb', 'sqlglot') if m in sys.modules))")
    assert "[]" in out, out


def test_bad_values_and_bodies_get_one_sentence_and_a_4xx(served, cli, capfd):
    target = served(PROBE_SNAPSHOT_BYTES="300")
    sock = target.entry["socket"]
    cases = [
        (b"not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests deeper"),
        (b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}", "nests deeper"),
        (json.dumps({"tables": {"python.threads": {}}, "timeout": "inf"}).encode(), "finite"),
        (json.dumps({"tables": {"python.threads": {}}, "timeout": 1e300}).encode(), "at most"),
        (json.dumps({"tables": {"python.threads": {"columns": ["nope"]}}}).encode(), "no column 'nope'"),
        (
            json.dumps({"tables": {"python.threads": {"filter": {"op": "exec", "col": "name"}}}}).encode(),
            "unknown snapshot filter",
        ),
        (b"\xff\xfe", "not valid JSON"),
    ]
    for body, fragment in cases:
        status, doc = post(sock, "/snapshot", body)
        assert 400 <= status < 500, (body[:40], status, doc)
        assert fragment in doc["error"] and doc["error"].endswith("."), doc
    # a negative or absurd Content-Length, and a body over the limit, are refused before reading
    for length in ("-5", "abc", "99999999999"):
        data = exchange(sock, f"POST /snapshot HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())
        assert data.startswith(b"HTTP/1.1 4"), data[:80]
    # HTTP/0.9 is answered (and closed), not left hanging
    data = exchange(sock, b"GET /health\r\n", timeout=5.0)
    assert b"HTTP/1.1 400" in data and b"HTTP/1.1" in data, data[:120]
    # the CLI's own checks: negative row cap, 5000 nested parentheses, a snapshot over the byte cap
    r = cli(target.pid, "query", "SELECT 1", "--max-rows", "-1")
    assert r.returncode == 2 and "--max-rows must be a whole number" in r.stderr, r.stderr
    r = cli(target.pid, "query", "SELECT " + "(" * 5000 + "1" + ")" * 5000)
    assert r.returncode == 2 and "nests too deeply" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli(target.pid, "query", "SELECT * FROM python.backtrace")
    assert r.returncode == 2 and "PROBE_SNAPSHOT_BYTES" in r.stderr, r.stderr
    # and the serving process printed no traceback and still answers
    assert cli(target.pid, "query", "SELECT 1 AS ok", "-f", "csv").stdout.split() == ["ok", "1"]
    printed = capfd.readouterr()
    assert "Traceback" not in printed.out + printed.err, printed


def test_connections_are_bounded_and_the_owner_is_always_answered(served, cli):
    # given a probe listening on TCP too, with small connection limits
    target = served(PROBE_PORT="0", PROBE_TOKEN="tok-en", PROBE_MAX_CONNECTIONS="4", PROBE_READ_TIMEOUT="1")
    entry = target.entry
    port = entry["tcp_port"]
    # when 60 TCP clients open connections and never finish their headers
    held = []
    for _ in range(60):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /snapshot HTTP/1.1\r\nContent-Le")
        held.append(s)
    try:
        # then the owner's unix socket still answers at once
        r = cli(target.pid, "query", "SELECT count(*) AS n FROM python.threads", "-f", "csv")
        assert r.returncode == 0, r.stderr
        # the server did not grow a thread per connection
        threads = int(
            cli(target.pid, "query", "SELECT count(*) AS n FROM python.threads", "-f", "csv").stdout.split()[1]
        )
        assert threads < 20, threads
        # and every slow client is cut off: answered 503 at once (over the limit) or closed after the read timeout
        closed = 0
        deadline = time.monotonic() + 30
        for s in held:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                data = s.recv(4096)
                while data and not data.endswith(b"}"):
                    more = s.recv(4096)
                    if not more:
                        break
                    data += more
                closed += 1
            except OSError:
                pass
        assert closed == len(held), f"{len(held) - closed} slow connections were left open"
    finally:
        for s in held:
            s.close()
    assert cli(target.pid, "query", "SELECT 1 AS ok", "-f", "csv").returncode == 0


def test_a_token_goes_only_to_the_address_it_was_issued_for(served, cli):
    # given a local job on 127.0.0.1:PORT and a stranger listening on 127.0.0.2 with the same port
    target = served(PROBE_PORT="0")
    entry = target.entry
    port = entry["tcp_port"]
    stranger = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        stranger.bind(("127.0.0.2", port))
    except OSError:
        stranger.close()
        pytest.skip("127.0.0.2 cannot be bound here")
    stranger.listen(4)
    got: list = []

    def serve():
        stranger.settimeout(20)
        try:
            conn, _ = stranger.accept()
            conn.settimeout(5)
            got.append(conn.recv(65536))
            conn.close()
        except OSError:
            pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        # when the CLI is pointed at the stranger
        r = cli(f"127.0.0.2:{port}", "query", "SELECT 1")
        # then it refuses for want of a token, and the stranger never saw the job's token
        assert r.returncode == 4 and "needs a token" in r.stderr, r.stderr
        assert not any(entry["key"].encode() in g for g in got)
        # while the real address still gets it from the registry
        ok = cli(f"127.0.0.1:{port}", "query", "SELECT 1 AS one", "-f", "csv")
        assert ok.returncode == 0, ok.stderr
    finally:
        stranger.shutdown(socket.SHUT_RDWR)  # wakes its accept: the stranger's thread ends with the test
        stranger.close()
        t.join(30)


def test_snapshots_wait_in_line_and_say_so(served):
    from concurrent.futures import ThreadPoolExecutor

    # given one snapshot slot, and python.threads holding it for its 50 ms sampling window
    target = served(PROBE_MAX_SNAPSHOTS="1")
    sock = target.entry["socket"]
    body = json.dumps({"tables": {"python.threads": {"columns": ["name", "executing"]}}, "timeout": 0.01}).encode()
    head = f"POST /snapshot HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    # when ten clients ask at once, each willing to wait 10 ms in line
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: exchange(sock, head + body), range(10)))
    statuses = [int(a.split(b" ", 2)[1]) for a in answers]
    # then the ones that could not get the slot in time got a 503 with one sentence; the rest their snapshot
    busy = [json.loads(a.partition(b"\r\n\r\n")[2]) for a, s in zip(answers, statuses) if s == 503]
    assert busy and 200 in statuses, statuses
    assert all("PROBE_MAX_SNAPSHOTS" in b["error"] and b["error"].endswith(".") for b in busy), busy


def _ask_backtrace(sock: str, timeout: float) -> tuple[int, bytes]:
    """One raw snapshot of python.backtrace on the unix socket ``sock``: (status, body of the answer)."""
    body = json.dumps({"tables": {"python.backtrace": {"columns": ["func", "depth"]}}, "timeout": timeout}).encode()
    answer = exchange(
        sock, f"POST /snapshot HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    )
    return int(answer.split(b" ", 2)[1]), answer.partition(b"\r\n\r\n")[2]


def _until_refused(sock: str, timeout: float) -> list:
    """Ask right after each answered snapshot, up to 20 times, until one is refused: the answers."""
    answers = []
    for _ in range(20):
        answers.append(_ask_backtrace(sock, timeout))
        if answers[-1][0] != 200:
            break
    return answers


def test_snapshots_are_paced_to_their_share_of_the_process(served, capfd):
    # given a process whose snapshots may take a millionth of its time (a microsecond a second)
    sock = served(PROBE_SERVE_SHARE="0.000001").entry["socket"]
    # when one query comes, it is answered at once (the bucket starts with its burst)
    status, _ = _ask_backtrace(sock, 5)
    assert status == 200
    # then the next one, which would have to wait longer than its timeout for the share to refill (the debt is
    # capped at one burst: up to a second), is refused within its timeout. The refill runs on wall time,
    # so a loaded host that delays the second query by most of a second lets it through (200, a correct
    # answer): ask again right after an answered one until the share is spent when one comes
    answers = _until_refused(sock, 0.05)
    status, body = answers[-1]
    assert status == 503 and all(s == 200 for s, _ in answers[:-1]), answers
    error = json.loads(body)["error"]
    assert (
        "PROBE_SERVE_SHARE" in error and "within 0.05 s" in error and error.endswith(".") and error.count(". ") == 0
    ), error
    printed = capfd.readouterr()
    assert "Traceback" not in printed.out + printed.err, printed


def test_a_new_start_serves_by_its_own_limits_not_the_last_ones(probe_env):
    # given a probe whose snapshots may take a millionth of the process's time and one at a time, share spent
    with serving(probe_env, PROBE_SERVE_SHARE="0.000001", PROBE_MAX_SNAPSHOTS="1") as first:
        assert _until_refused(first.entry["socket"], 0.05)[-1][0] == 503
    # when the probe is stopped and started again with the default limits
    with serving(probe_env) as second:
        # then its readers are paced and queued by those: every snapshot asked back to back is answered
        answers = [_ask_backtrace(second.entry["socket"], 0.05) for _ in range(5)]
    assert [s for s, _ in answers] == [200] * 5, answers
