"""The page's server against other local users and other web pages.

`probe ui --open` never puts the token on a command line; every request must name this server
(Host: DNS rebinding) and come from its origin; POSTs need the page's CSRF header; idle
connections cannot make a thread each. Real `probe ui` processes, raw HTTP (the browser tests
in tests/cli/test_ui.py drive the page itself), reading probe's agent served from the test's own process.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import threading
import urllib.error
import urllib.request

import pytest

from conftest import PROBE_BIN, poll
from harness import start, stop_groups


class UI:
    def __init__(self, env, *args):
        self.proc = start([PROBE_BIN, *args], env, ready="Ctrl-C", timeout=60)
        self.lines = self.proc.lines
        self.url = next(
            m.group(0) for line in self.lines for m in [re.search(r"http://127\.0\.0\.1:\d+/\S+/", line)] if m
        )
        self.port = int(re.match(r"http://127\.0\.0\.1:(\d+)/", self.url).group(1))
        self.token = self.url.rstrip("/").rsplit("/", 1)[1]

    def close(self):
        stop_groups([self.proc.popen], grace=5)


@pytest.fixture
def idle(served):
    """The probed process the page reads: probe's agent served from the test's own process."""
    return served()


def _raw(port: int, head: str, body: bytes = b"") -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(head.encode() + body)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]


def test_open_keeps_the_token_off_every_command_line(idle, probe_env, tmp_path):
    # given a "browser" that records the command line it is started with
    seen = tmp_path / "argv.txt"
    browser = tmp_path / "browser.sh"
    browser.write_text(f'#!/bin/sh\nprintf "%s\\n" "$0" "$@" > {seen}\n')
    browser.chmod(0o755)
    env = dict(probe_env, BROWSER=str(browser), DISPLAY=":99")
    ui = UI(env, idle.pid, "ui", "--port", "0", "--open")
    try:
        assert poll(lambda: seen.exists() and seen.read_text().strip(), 30), "the browser was not started"
        argv = seen.read_text()
        # then what every user can read in ps holds no token, only the path of a file
        assert ui.token not in argv, argv
        opened = re.search(r"file://(\S+)", argv).group(1)
        # a file only this user can read (in a directory only this user can list), which leads to the page
        assert stat.S_IMODE(os.stat(opened).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(opened)).st_mode) == 0o700
        assert ui.url in open(opened).read()
        with urllib.request.urlopen(ui.url, timeout=20) as resp:
            assert resp.status == 200
        # and once the page was loaded the file is gone
        assert poll(lambda: not os.path.exists(opened), 20), "the launch file was left behind"
    finally:
        ui.close()


def test_host_and_origin_are_checked_on_every_request(idle, probe_env):
    ui = UI(probe_env, idle.pid, "ui", "--port", "0")
    try:
        path = f"/{ui.token}/api/config"
        ok = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{ui.port}\r\nConnection: close\r\n\r\n"
        status, body = _raw(ui.port, ok)
        assert status == 200 and "csrf" in json.loads(body), body
        # a DNS-rebinding page reaches the port under its own name: refused, even with the token
        status, body = _raw(
            ui.port, f"GET {path} HTTP/1.1\r\nHost: rebind.example:{ui.port}\r\nConnection: close\r\n\r\n"
        )
        assert status == 403 and b"Host" in body, body
        status, _ = _raw(ui.port, f"GET {path} HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert status == 403
        # a request sent by a page of another origin: refused
        status, body = _raw(
            ui.port,
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{ui.port}\r\nOrigin: http://evil.example\r\n"
            "Connection: close\r\n\r\n",
        )
        assert status == 403 and b"origin" in body, body
        status, _ = _raw(
            ui.port,
            f"GET {path} HTTP/1.1\r\nHost: localhost:{ui.port}\r\nOrigin: http://localhost:{ui.port}\r\n"
            "Connection: close\r\n\r\n",
        )
        assert status == 200
    finally:
        ui.close()


def test_posts_need_the_pages_csrf_header(idle, probe_env):
    ui = UI(probe_env, idle.pid, "ui", "--port", "0", "--allow-actions")
    try:
        csrf = json.loads(urllib.request.urlopen(ui.url + "api/config", timeout=20).read())["csrf"]
        body = json.dumps({"sql": "SELECT 1 AS one"}).encode()
        head = (
            f"POST /{ui.token}/api/query HTTP/1.1\r\nHost: 127.0.0.1:{ui.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        )
        # without the header (a form, or a script of another page that cannot read api/config): refused
        status, answer = _raw(ui.port, head + "\r\n", body)
        assert status == 403 and b"X-Probe-CSRF" in answer, answer
        status, _ = _raw(ui.port, head + "X-Probe-CSRF: guessed\r\n\r\n", body)
        assert status == 403
        # with it: answered
        status, answer = _raw(ui.port, head + f"X-Probe-CSRF: {csrf}\r\n\r\n", body)
        assert status == 200 and json.loads(answer)["rows"] == [[1]], answer
        action = json.dumps({"name": "cleanup", "confirmed": True}).encode()
        status, _ = _raw(
            ui.port, head.replace("api/query", "api/action").replace(str(len(body)), str(len(action))) + "\r\n", action
        )
        assert status == 403
    finally:
        ui.close()


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def test_idle_connections_cannot_make_a_thread_each(idle, probe_env):
    ui = UI(probe_env, idle.pid, "ui", "--port", "0")
    held = []
    try:
        # when 3000 connections are opened and left idle
        for _ in range(3000):
            try:
                held.append(socket.create_connection(("127.0.0.1", ui.port), timeout=10))
            except OSError:
                break
        assert len(held) >= 1000, f"only {len(held)} connections could be opened"
        peak = 0
        for _ in range(10):  # the server accepts them in its own time: look several times
            peak = max(peak, _threads(ui.proc.pid))
            threading.Event().wait(0.3)  # ok-sleep: sampling the thread count while the connections are held
        # then the page's process did not grow a thread per connection
        assert peak < 100, f"probe ui ran {peak} threads for {len(held)} idle connections"
    finally:
        for s in held:
            s.close()

    # and once they are gone the page answers again
    def answers():
        try:
            return urllib.request.urlopen(ui.url + "api/config", timeout=10).status == 200
        except (urllib.error.URLError, OSError):
            return False

    try:
        assert poll(answers, 60)
    finally:
        ui.close()


def test_malformed_bodies_and_parameters_get_400_and_one_sentence(idle, probe_env):
    ui = UI(probe_env, idle.pid, "ui", "--port", "0")
    try:
        csrf = json.loads(urllib.request.urlopen(ui.url + "api/config", timeout=20).read())["csrf"]

        def post(route: str, body: bytes) -> tuple[int, dict]:
            head = (
                f"POST /{ui.token}/{route} HTTP/1.1\r\nHost: 127.0.0.1:{ui.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nX-Probe-CSRF: {csrf}\r\nConnection: close\r\n\r\n"
            )
            status, answer = _raw(ui.port, head, body)
            return status, json.loads(answer)

        # given bodies that are not a JSON object: a list, a string, a 100,000-deep nesting, not JSON at all
        for body in (b"[1, 2]", b'"SELECT 1"', b"[" * 100_000 + b"]" * 100_000, b"{not json"):
            status, answer = post("api/query", body)
            assert (status, answer["error"]) == (400, "the request body must be a JSON object under 1 MiB."), body[:20]
        # and parameters of the wrong type or out of range
        for max_rows in ("abc", -5, 0, 1.5, True, 10**12):
            status, answer = post("api/query", json.dumps({"sql": "SELECT 1 AS one", "max_rows": max_rows}).encode())
            error = answer.get("error", "")
            assert status == 400 and error.startswith("max_rows must be a whole number from 1 to"), (max_rows, error)
        for seconds in ("abc", float("nan"), -1, 1e9):
            status, answer = post("api/profile", json.dumps({"seconds": seconds}).encode())
            error = answer.get("error", "")
            assert status == 400 and error.startswith("seconds must be a number of seconds"), (seconds, error)
        # then the page still answers, and wrote no traceback
        status, answer = post("api/query", json.dumps({"sql": "SELECT 1 AS one", "max_rows": 5}).encode())
        assert status == 200 and answer["rows"] == [[1]], answer
        assert "Traceback" not in ui.proc.output(), ui.proc.output()
    finally:
        ui.close()
