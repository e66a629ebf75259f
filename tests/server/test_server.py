"""The foundation end to end: a real target process, the real `probe` command; the TCP listener, its token and
the registry entry's key against probe's agent served from the test's own process (``served``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import TARGETS
from harness import run_probe

SEED_BACKTRACE = "SELECT func, file, lineno, depth\nFROM python.backtrace\nORDER BY depth\nLIMIT 10"


@pytest.fixture(scope="module")
def idle(shared_spawn):
    """One idle target for every test of this file that only reads it (with ``shared_cli``)."""
    return shared_spawn(TARGETS / "idle.py")


def test_backtrace_shows_every_thread_innermost_first(idle, shared_cli):
    r = shared_cli(idle.pid, "backtrace")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert '"MainThread" (main)' in out
    assert '"data-worker"' in out
    main_part = out.split('"MainThread"')[1].split("Thread ")[0]
    first = main_part.strip().splitlines()[1]
    assert first.strip().startswith("#0") and "main_loop" in first and "idle.py" in first


def test_backtrace_thread_filter_and_locals(idle, shared_cli):
    r = shared_cli("-t", str(idle.pid), "backtrace", "--thread", "MainThread", "--locals")
    assert r.returncode == 0, r.stderr
    assert "data-worker" not in r.stdout
    assert "n = " in r.stdout  # main_loop's local counter
    r = shared_cli(idle.pid, "backtrace", "--thread", "nope")
    assert r.returncode != 0 and "no thread named" in r.stderr and "Traceback" not in r.stderr


def test_seed_backtrace_query_runs_verbatim(idle, shared_cli):
    r = shared_cli(idle.pid, "query", SEED_BACKTRACE, "-f", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert 1 <= len(rows) <= 10
    assert set(rows[0]) == {"func", "file", "lineno", "depth"}
    assert [row["depth"] for row in rows] == sorted(row["depth"] for row in rows)
    assert any(row["func"] == "main_loop" and row["depth"] == 0 for row in rows)


def test_formats_table_json_csv(idle, shared_cli):
    sql = "SELECT name, daemon FROM python.threads ORDER BY name"
    table = shared_cli(idle.pid, "query", sql)
    assert table.returncode == 0 and "data-worker" in table.stdout and "│" in table.stdout
    csv = shared_cli(idle.pid, "--format", "csv", "query", sql)
    assert csv.stdout.splitlines()[0] == "name,daemon"
    assert "data-worker,True" in csv.stdout


def test_process_info_and_env_redaction(spawn, cli):
    proc = spawn(
        TARGETS / "idle.py", env={"MY_API_TOKEN": "hunter2", "HARMLESS": "visible", "RANK": "3", "WORLD_SIZE": "8"}
    )
    info = json.loads(
        cli(proc.pid, "query", "SELECT pid, rank, world_size, rss_bytes, torch FROM process.info", "-f", "json").stdout
    )[0]
    assert info["pid"] == proc.pid and info["rank"] == 3 and info["world_size"] == 8
    assert info["rss_bytes"] > 1_000_000 and info["torch"] is None
    env = dict(
        (r["name"], r["value"])
        for r in json.loads(cli(proc.pid, "query", "SELECT name, value FROM process.env", "-f", "json").stdout)
    )
    assert env["MY_API_TOKEN"] == "<redacted>" and env["HARMLESS"] == "visible"
    assert "hunter2" not in cli(proc.pid, "query", "SELECT * FROM process.env").stdout


def test_plain_process_without_torch(idle, shared_cli):
    assert "torch=False" in idle.lines[0]
    r = shared_cli(idle.pid, "query", "SELECT COUNT(*) AS n FROM python.threads", "-f", "json")
    assert json.loads(r.stdout)[0]["n"] >= 3


@pytest.mark.parametrize(
    "sql, fragment",
    [
        ("DROP TABLE python.threads", "only read queries"),
        ("COPY (SELECT 1) TO '/tmp/probe-copy.csv'", "only read queries"),
        ("ATTACH '/tmp/x.db'", "only read queries"),
        ("INSTALL httpfs", "only read queries"),
        ("LOAD httpfs", "only read queries"),
        ("PRAGMA threads=8", "only read queries"),
        ("SET memory_limit='100GB'", "only read queries"),
        ("SELECT * FROM read_csv('/etc/passwd')", "not allowed"),
        ("SELECT * FROM read_parquet('x.parquet')", "not allowed"),
        ("SELECT * FROM read_text('/etc/passwd')", "not allowed"),
        ("SELECT * FROM glob('/*')", "not allowed"),
        ("SELECT 1; SELECT 2", "one statement"),
        ("SELECT * FROM python.nope", "known tables"),
        ("SELECT func FROM python.backtrace WHERE", "syntax error"),
    ],
)
def test_refused_sql_leaves_the_process_unharmed(idle, shared_cli, sql, fragment):
    r = shared_cli(idle.pid, "query", sql)
    assert r.returncode == 2
    assert fragment in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert shared_cli(idle.pid, "query", "SELECT 1 AS ok").returncode == 0
    assert idle.popen.poll() is None


def test_runaway_query_is_interrupted(idle, shared_cli):
    r = shared_cli(idle.pid, "--timeout", "1", "query", "SELECT COUNT(*) FROM range(1000000) a, range(1000000) b")
    assert r.returncode == 2 and "timeout" in r.stderr
    assert shared_cli(idle.pid, "query", "SELECT 1 AS ok").returncode == 0


def test_row_cap_and_raise(idle, shared_cli):
    r = shared_cli(idle.pid, "query", "SELECT * FROM range(20000)", "-f", "csv")
    assert len(r.stdout.splitlines()) == 10001
    r = shared_cli(idle.pid, "query", "SELECT * FROM range(20000)", "-f", "csv", "--max-rows", "15000")
    assert len(r.stdout.splitlines()) == 15001


def test_tables_and_describe(idle, shared_cli):
    r = shared_cli(idle.pid, "tables")
    for name in (
        "python.backtrace",
        "python.threads",
        "process.info",
        "process.env",
        "probe.tables",
        "probe.columns",
        "probe.errors",
    ):
        assert name in r.stdout
    d = shared_cli(idle.pid, "describe", "python.backtrace")
    assert "depth" in d.stdout and "innermost" in d.stdout
    bad = shared_cli(idle.pid, "describe", "python.nope")
    assert bad.returncode != 0 and "known tables" in bad.stderr


def test_list_shows_the_process_and_cleans_stale_entries(idle, shared_cli, shared_env):
    stale = Path(shared_env["PROBE_RUNTIME_DIR"]) / "999999.json"
    stale.write_text(json.dumps({"pid": 999999, "host": socket.gethostname(), "socket": "/nonexistent"}))
    r = shared_cli("list", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["pid"] for row in rows] == [idle.pid]
    assert not stale.exists()


def test_probe_env_start_without_code_change(spawn, cli):
    proc = spawn(TARGETS / "plain_no_probe.py", env={"PROBE": "1"})
    assert "probe_loaded=True" in proc.lines[0]  # started by the .pth at interpreter start
    r = cli(proc.pid, "query", "SELECT func FROM python.backtrace WHERE is_main AND depth = 0", "-f", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["func"] == "<module>"


def test_without_probe_env_nothing_starts(spawn, cli):
    proc = spawn(TARGETS / "plain_no_probe.py")
    assert "probe_loaded=False" in proc.lines[0]
    assert cli("list", "--json").stdout.strip() == "[]"


def test_import_probe_has_no_side_effects(probe_env):
    code = (
        "import sys, threading, probe; print(probe.is_running(), threading.active_count(), 'torch' in sys.modules, "
        "'duckdb' in sys.modules, 'numpy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=probe_env).stdout.split()
    assert out == ["False", "1", "False", "False", "False"]
    assert os.listdir(probe_env["PROBE_RUNTIME_DIR"]) == []


def test_cli_does_not_import_torch(probe_env):
    code = (
        "import sys; from probe.cli import main; "
        "from probe.cli.commands import load_all; load_all(); print('torch' in sys.modules)"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=probe_env).stdout.strip()
        == "False"
    )


def test_python_dash_m_probe(idle, shared_env):
    r = subprocess.run(
        [sys.executable, "-m", "probe", str(idle.pid), "query", "SELECT 42 AS answer", "-f", "csv"],
        capture_output=True,
        text=True,
        env=shared_env,
        cwd=shared_env["PROBE_RUNTIME_DIR"],
    )
    assert r.stdout.splitlines() == ["answer", "42"], r.stderr


@pytest.mark.parametrize(
    "args, fragment, code",
    [
        (["999999", "backtrace"], "no process with pid 999999", 3),
        (["nonsense-endpoint", "backtrace"], "unknown command", 1),
        (["127.0.0.1:1", "query", "SELECT 1"], "needs a token", 4),
        (["/tmp/no-such-probe.sock", "tables"], "no socket at", 3),
        (["query", "SELECT 1"], "needs a process", 1),
        (["frobnicate"], "unknown command", 1),
    ],
)
def test_bad_input_is_one_sentence_and_nonzero(cli, args, fragment, code):
    r = cli(*args)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert fragment in r.stderr and "Traceback" not in r.stderr


def test_pid_without_probe(spawn, cli):
    proc = spawn(TARGETS / "plain_no_probe.py")
    r = cli(proc.pid, "query", "SELECT 1")
    assert r.returncode == 3 and "has no probe" in r.stderr and "probe inject" in r.stderr


# --- TCP and token -------------------------------------------------------------------------


@pytest.fixture
def tcp_target(served):
    return served(PROBE_PORT="0", PROBE_TOKEN="s3cret-token")


def _tcp_port(cli, pid):
    rows = json.loads(cli("list", "--json").stdout)
    endpoint = next(r["endpoint"] for r in rows if r["pid"] == pid)
    return int(endpoint.rsplit(":", 1)[1])


def test_tcp_requires_the_token(tcp_target, cli, probe_env):
    port = _tcp_port(cli, tcp_target.pid)
    env = {k: v for k, v in probe_env.items()}
    env["PROBE_RUNTIME_DIR"] = "/tmp/probe-test-empty-registry"  # the CLI must not find the token locally
    missing = run_probe(f"127.0.0.1:{port}", "query", "SELECT 1", env=env)
    assert missing.returncode == 4 and "token" in missing.stderr
    wrong = run_probe("--token", "nope", f"127.0.0.1:{port}", "query", "SELECT 1", env=env)
    assert wrong.returncode == 4 and "wrong token" in wrong.stderr
    right = run_probe("--token", "s3cret-token", f"127.0.0.1:{port}", "query", "SELECT 7 AS x", "-f", "csv", env=env)
    assert right.stdout.splitlines() == ["x", "7"], right.stderr
    via_env = run_probe("-t", f"127.0.0.1:{port}", "backtrace", env=dict(env, PROBE_TOKEN="s3cret-token"))
    assert via_env.returncode == 0 and "MainThread" in via_env.stdout


def test_tcp_401_reveals_nothing(tcp_target, cli):
    port = _tcp_port(cli, tcp_target.pid)
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    body = json.dumps({"tables": {"process.env": {}}}).encode()
    s.sendall(b"POST /snapshot HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 401")
    doc = json.loads(body)
    assert set(doc) == {"error", "kind", "exit_code"} and "token" in doc["error"]
    assert b"PATH" not in body and b"python" not in body


def test_the_rank_key_lives_in_a_private_registry_entry(served, cli, probe_env):
    proc = served(PROBE_PORT="0")
    entry = Path(probe_env["PROBE_RUNTIME_DIR"]) / f"{proc.pid}.json"
    assert oct(entry.stat().st_mode & 0o777) == "0o600"
    assert oct(Path(probe_env["PROBE_RUNTIME_DIR"]).stat().st_mode & 0o777) == "0o700"
    doc = json.loads(entry.read_text())
    assert len(doc["key"]) == 64 and "token" not in doc  # the rank's own key, never the job's token
    port = _tcp_port(cli, proc.pid)
    r = cli(f"127.0.0.1:{port}", "query", "SELECT 1 AS one", "-f", "csv")  # key found in the local registry
    assert r.stdout.splitlines() == ["one", "1"], r.stderr


# --- robustness ---------------------------------------------------------------------------


def test_client_that_disconnects_mid_response(idle, shared_cli, shared_env):
    sock_path = str(Path(shared_env["PROBE_RUNTIME_DIR"]) / f"{idle.pid}.sock")
    body = json.dumps({"tables": {"python.backtrace": {}, "process.env": {}, "probe.columns": {}}}).encode()
    for _ in range(5):
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock_path)
        s.sendall(b"POST /snapshot HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        s.recv(100)  # the response has started
        s.close()  # and we leave
    half = socket.socket(socket.AF_UNIX)
    half.connect(sock_path)
    half.sendall(b'POST /snapshot HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"tables"')  # never finishes
    half.close()
    assert idle.popen.poll() is None
    r = shared_cli(idle.pid, "query", "SELECT COUNT(*) AS n FROM python.threads", "-f", "csv")
    assert r.returncode == 0 and r.stdout.splitlines()[0] == "n"


def test_twenty_concurrent_clients(idle, shared_env):
    results = [None] * 20

    def run(i):
        results[i] = run_probe(
            idle.pid,
            "query",
            f"SELECT {i} AS i, COUNT(*) AS frames FROM python.backtrace",
            "-f",
            "json",
            env=shared_env,
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in enumerate(results):
        assert r.returncode == 0, r.stderr
        row = json.loads(r.stdout)[0]
        assert row["i"] == i and row["frames"] > 0
    assert idle.popen.poll() is None
