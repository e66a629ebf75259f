"""What a client without the token, or with expensive snapshots, can take from the training process.

Each test drives a probed process that prints ``step N`` and ends by checking that it kept stepping: the
``agent`` fixture's (no torch) where only the server is at stake, a real training loop
(tests/targets/actions_train.py) where the snapshots must have rows to cost something; the pacing of backtraces
and profiles, a route's limit alone, is checked against probe's agent served from the test's own process.
"""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

from conftest import TARGETS, poll, requires_torch
from harness import exchange, last_step, registry_entry, steps_on


def _still_stepping(proc) -> None:
    assert steps_on(proc), f"training stopped at step {last_step(proc)}:\n" + proc.output()[-2000:]
    assert proc.popen.poll() is None and "Traceback" not in proc.output(), proc.output()[-2000:]


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


TOKEN = "the-right-token-1234"


def _train(spawn, **env):
    return spawn(
        [TARGETS / "actions_train.py", "--sched", "none", "--step-sleep", "0.01"],
        env={"PROBE_PORT": "0", "PROBE_TOKEN": TOKEN, **env},
    )


def test_trickling_tcp_clients_are_cut_off_and_never_lock_the_owner_out(agent, cli):
    # given a probed process on TCP too, each request head allowed 2 s in all
    target = agent(PROBE_PORT="0", PROBE_TOKEN=TOKEN, PROBE_READ_TIMEOUT="2")
    port = target.entry["tcp_port"]
    # when 32 TCP clients (every connection slot) each send a header byte twice a second, forever
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(32)]
    cut = [False] * len(held)
    stop = threading.Event()

    def trickle():
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        while not stop.is_set() and not all(cut):
            for i, s in enumerate(held):
                if cut[i]:
                    continue
                try:
                    s.sendall(b"a")
                    s.setblocking(False)
                    try:
                        if s.recv(4096) == b"":
                            cut[i] = True
                    except BlockingIOError:
                        pass
                    finally:
                        s.setblocking(True)
                except OSError:
                    cut[i] = True
            stop.wait(0.5)  # ok-sleep: the attacker's pace, one byte per client twice a second

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        # then the owner, over the unix socket, is answered while they hold their connections
        r = cli(target.pid, "query", "SELECT max(step) AS s FROM torch.steps", "-f", "csv")
        assert r.returncode == 0, r.stderr
        # and every trickling client is cut off, however steadily it sends (the head has one deadline)
        assert poll(lambda: all(cut), 60), f"{cut.count(False)} trickling clients still hold a connection"
        # and a client with the token is served again
        ok = cli(f"127.0.0.1:{port}", "--token", TOKEN, "query", "SELECT 1 AS one", "-f", "csv")
        assert ok.returncode == 0, ok.stderr
    finally:
        stop.set()
        t.join(10)
        for s in held:
            s.close()
    _still_stepping(target)


N_ATTACKS = 96


def test_large_headers_without_the_token_cost_the_process_no_memory(agent, cli):
    # given a probed process on TCP
    target = agent(PROBE_PORT="0", PROBE_TOKEN=TOKEN)
    port = target.entry["tcp_port"]
    assert cli(target.pid, "query", "SELECT 1", "-f", "csv").returncode == 0  # warm: the CLI's first query's memory
    before = _rss_kb(target.pid)
    head = b"POST /snapshot HTTP/1.1\r\nHost: x\r\n" + (b"X-Pad: " + b"a" * 60_000 + b"\r\n") * 99
    refused = []
    together = threading.Barrier(32, timeout=120)

    def attack(_):
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        try:
            try:
                s.sendall(head)
            except OSError:
                pass  # cut off mid-head: what should happen
            try:
                together.wait()  # all 32 heads are in the server at once before any ends
            except threading.BrokenBarrierError:
                pass
            try:
                s.sendall(b"Authorization: Bearer wrong\r\n\r\n")
            except OSError:
                pass
            try:
                answer = s.recv(65536)
                refused.append(answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/1.1 ") else b"closed")
            except OSError:
                refused.append(b"closed")
        finally:
            s.close()

    # when 32 clients at a time, N_ATTACKS in all, each send 99 headers of 60 KB and a wrong token
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(attack, range(N_ATTACKS)))
    # then none was served, and the process holds no more than a few MB more than before
    assert len(refused) == N_ATTACKS and b"200" not in refused, refused
    grown_mb = (_rss_kb(target.pid) - before) / 1024
    print(f"RSS grew by {grown_mb:.1f} MB")
    assert grown_mb < 24, f"the training process grew by {grown_mb:.0f} MB"
    # and the right token still works, over TCP, with ordinary headers
    ok = cli(f"127.0.0.1:{port}", "--token", TOKEN, "query", "SELECT 1 AS one", "-f", "csv")
    assert ok.returncode == 0, ok.stderr
    _still_stepping(target)


def _heavy_body(timeout: float) -> bytes:
    """A snapshot of every table's columns, each with a filter tree of OR'd comparisons (256 nodes in all)."""
    from probe.tables.registry import all_tables

    tables = {}
    nodes = 0
    for t in all_tables():
        if t.kind == "client":
            continue
        col = t.columns[0].name
        tables[t.name] = {
            "columns": [c.name for c in t.columns],
            "filter": {"or": [{"op": "!=", "col": col, "value": i} for i in range(10)]},
        }
        nodes += 11
        if nodes > 230:
            break
    return json.dumps({"tables": tables, "timeout": timeout}).encode()


def _snapshot(path: str, body: bytes) -> tuple[int, bytes]:
    """One raw POST /snapshot on the unix socket ``path``: (status, body of the answer)."""
    data = exchange(path, f"POST /snapshot HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]


@requires_torch
def test_expensive_snapshots_are_charged_their_whole_cost(spawn, probe_env):
    # given a training process whose snapshots may take a tenth of a percent of its time (the share is spent in a few
    # heavy snapshots: at half a percent, a fast host served dozens first, over a minute of the suite)
    target = _train(spawn, PROBE_SERVE_SHARE="0.001")
    sock = registry_entry(target.pid, probe_env)["socket"]
    # when a client sends snapshots with heavy filter trees over every table, each willing to wait 2 s
    statuses, refusal = [], None
    for _ in range(60):
        status, body = _snapshot(sock, _heavy_body(2.0))
        statuses.append(status)
        if status == 503:
            refusal = json.loads(body)["error"]
            break
    # then, once they have spent the share, the next one would wait longer than it may and is told so:
    # a debt capped at one burst (the old pacing) never made one wait over a second, whatever it cost
    assert refusal is not None, f"{len(statuses)} heavy snapshots were all served: {statuses}"
    assert "PROBE_SERVE_SHARE" in refusal and refusal.endswith("."), refusal
    _still_stepping(target)


def _tcp_snapshot(port: int, body: bytes, token: str = TOKEN) -> int:
    """The HTTP status of one snapshot asked over TCP with the token (0: the connection failed)."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
    except OSError:
        return 0
    try:
        s.sendall(
            f"POST /snapshot HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        data = s.recv(64)
        while data and b" " not in data[:12]:
            more = s.recv(64)
            if not more:
                break
            data += more
        return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    except OSError:
        return 0
    finally:
        s.close()


def test_token_holders_flooding_over_tcp_never_lock_the_owner_out(agent, cli):
    # given a probed process on TCP too, whose readers may take half a percent of its time
    target = agent(PROBE_PORT="0", PROBE_TOKEN=TOKEN, PROBE_SERVE_SHARE="0.005")
    port = target.entry["tcp_port"]
    body = json.dumps({"tables": {"python.backtrace": {"columns": ["func", "depth"]}}, "timeout": 2}).encode()
    statuses: list = []
    stop = threading.Event()

    def flood():
        while not stop.is_set():
            statuses.append(_tcp_snapshot(port, body))

    # when 16 clients holding the token ask for snapshots back to back, until TCP's share is spent
    pool = [threading.Thread(target=flood, daemon=True) for _ in range(16)]
    for t in pool:
        t.start()
    try:
        assert poll(lambda: 503 in statuses, 60), f"the flood was never paced: {len(statuses)} answers"
        # then each of the owner's queries over the unix socket, during the flood, is answered
        answers = [
            cli(target.pid, "query", "SELECT max(step) AS s FROM torch.steps", "-f", "csv", "--timeout", "10")
            for _ in range(6)
        ]
        failed = [(r.returncode, r.stderr.strip()) for r in answers if r.returncode != 0]
        assert not failed, f"{len(failed)} of the owner's 6 queries failed: {failed}"
        # and so is the owner's backtrace
        bt = cli(target.pid, "backtrace")
        assert bt.returncode == 0 and "MainThread" in bt.stdout, bt.stderr
    finally:
        stop.set()
        for t in pool:
            t.join(30)
    # and right after it, too
    after = cli(target.pid, "query", "SELECT max(step) AS s FROM torch.steps", "-f", "csv")
    assert after.returncode == 0, after.stderr
    _still_stepping(target)


def _get(path: str, route: str) -> tuple[int, dict]:
    data = exchange(path, f"GET {route} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return int(data.split(b" ", 2)[1]), json.loads(data.partition(b"\r\n\r\n")[2] or b"{}")


def test_backtraces_and_profiles_are_paced_like_snapshots(served, capfd):
    # given a probe whose readers may take a millionth of the process's time (a microsecond a second)
    sock = served(PROBE_SERVE_SHARE="0.000001").entry["socket"]
    # when one backtrace comes, it is answered (the share starts with its burst)
    status, doc = _get(sock, "/backtrace?wait=0.05")
    assert status == 200 and doc["threads"], doc
    # then the next ones, which would wait longer than their timeout for the share to refill, are refused within
    # it; the refill runs on wall time, so a loaded host may let one more through: ask again until one is refused
    answers = []
    for _ in range(20):
        answers.append(_get(sock, "/backtrace?wait=0.05"))
        if answers[-1][0] != 200:
            break
    status, doc = answers[-1]
    assert status == 503, [s for s, _ in answers]
    assert "PROBE_SERVE_SHARE" in doc["error"] and doc["error"].endswith("."), doc
    # and a profile, charged to the same share, waits its turn the same way
    status, doc = _get(sock, "/profile?seconds=0.2&wait=0.05")
    assert status == 503 and "PROBE_SERVE_SHARE" in doc["error"], (status, doc)
    printed = capfd.readouterr()
    assert "Traceback" not in printed.out + printed.err, printed


def test_a_backtrace_of_many_threads_shows_a_bounded_number_and_counts_the_rest(spawn, cli):
    # given a process with 300 threads parked in the same function
    target = spawn([TARGETS / "many_threads.py", "300"])
    # when its backtrace is asked for
    r = cli(target.pid, "--format", "json", "backtrace")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # then a bounded number of threads come with their stacks, main first, and the rest are counted by where they wait
    shown = len(doc["threads"])
    assert shown < 300 and doc["threads"][0]["is_main"], shown
    left = doc.get("left_out") or {}
    assert left.get("limit") == shown and left["threads"] + shown >= 301, left
    assert left["where"][0]["threads"] >= 300 - shown - 1, left  # the parked threads all wait on the same line
    # and the human rendering says so
    text = cli(target.pid, "backtrace").stdout
    assert f"{left['threads']} more threads not shown" in text and "python.backtrace" in text, text[-2000:]
