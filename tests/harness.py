"""The one harness for the processes tests and benchmarks drive: a clean environment, starting a
target and waiting for its ready line, polling with a deadline, running the real ``probe`` command,
and stopping process groups; and, for the tests of routes, limits and auth, probe's agent served from the
test's own process (``serving``), checked to leave nothing behind when it stops. No pytest here:
``tests/conftest.py`` wraps it in fixtures, and benchmarks import it directly::

    sys.path.insert(0, str(ROOT / "tests")); from harness import Spawner, clean_env, poll

Nothing here waits on a fixed time: every wait has a deadline and ends as soon as its condition holds.
With ``use_fork_server(True)`` (the suite's conftest; never the benchmarks), target scripts that import
torch and the ``probe`` command start as forks of servers that imported them once (``tests/forkserver.py``),
where a fork can stand in for a spawn.
"""

from __future__ import annotations

import array
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "ROOT",
    "TARGETS",
    "EXAMPLES",
    "PROBE_BIN",
    "clean_env",
    "poll",
    "Proc",
    "start",
    "run_target",
    "Spawner",
    "run_probe",
    "stop_groups",
    "ptrace_refused",
    "use_fork_server",
    "Recorder",
    "registry_entry",
    "exchange",
    "post",
    "query_json",
    "last_step",
    "max_step",
    "steps_on",
    "audit_records",
    "other_uid",
    "InProcess",
    "serving",
    "process_state",
]

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ROOT / "tests" / "targets"
EXAMPLES = ROOT / "examples"
_beside = Path(sys.executable).with_name("probe")
PROBE_BIN = str(_beside) if _beside.exists() else shutil.which("probe")


def _runs_with_this_python(script: str | None) -> bool:
    """Whether ``script``'s ``#!`` line names this interpreter (the same file, in the same environment's bin)."""
    try:
        with open(script, "rb") as f:
            line = f.readline()
    except (OSError, TypeError):
        return False
    if not line.startswith(b"#!"):
        return False
    named = os.fsdecode(line[2:].strip())
    here = sys.executable
    return named == here or (
        os.path.dirname(named) == os.path.dirname(here) and os.path.realpath(named) == os.path.realpath(here)
    )


_PROBE_SCRIPT = _runs_with_this_python(PROBE_BIN)  # pip's console script: a Python file run by this interpreter


def clean_env(runtime_dir: str | None = None, *, prefix: str = "pr-", **extra: str) -> dict:
    """This process's environment without any ``PROBE*`` setting, unbuffered output, one OpenMP thread
    (unless set), and its own runtime dir: ``runtime_dir``, or a new short one under /tmp (unix-socket
    paths have a 108-byte limit). ``extra`` is applied last (``PROBE="1"`` to start the probe)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE")}
    env["PROBE_RUNTIME_DIR"] = runtime_dir or tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


_doctor_plans: dict = {}  # the plans this test worker's doctor runs kept, the most recent last


def share_doctor_plans(runtime_dir: str, *, give: bool) -> None:
    """``give``: a runtime dir without a plan cache gets the plans this worker's doctor runs made before; else the
    plans its doctor run kept are taken in. A plan is a pure function of the rule's SQL, the schema, the settings and
    probe's SQL code (the cache's key), so a test's first doctor run reads the plans a user's second run would: the
    planning of every rule (~0.7 s of CPU a run) is made once per schema, not once per test."""
    from probe.sql.plan_cache import _FILE, _KEEP  # the doctor's plan cache in the runtime dir, and its size

    path = os.path.join(runtime_dir, _FILE)
    try:
        if give:
            if _doctor_plans and not os.path.exists(path):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(_doctor_plans, f)
            return
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError):  # no runtime dir (a test that removed it), or no plans kept: nothing to share
        return
    for key, plan in kept.items():
        _doctor_plans.pop(key, None)
        _doctor_plans[key] = plan
    for key in list(_doctor_plans)[: max(0, len(_doctor_plans) - _KEEP)]:
        del _doctor_plans[key]


def poll(fn, timeout: float = 30.0, interval: float = 0.2):
    """Call ``fn`` until it returns a truthy value or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)  # ok-sleep: polling with a deadline


class Proc:
    """A started process whose combined stdout/stderr lines are collected as they come (``lines``)."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._pump, args=(popen, self.lines), daemon=True)
        self._reader.start()

    @staticmethod
    def _pump(popen: subprocess.Popen, lines: list[str]) -> None:
        for line in popen.stdout:
            lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        """Wait until a line containing ``text`` has been printed; return that line."""
        return self.wait_line(lambda line: text in line, repr(text), timeout=timeout)

    def wait_match(self, pattern: str, *, start: int = 0, count: int = 1, timeout: float = 60.0) -> list[re.Match]:
        """Wait until ``count`` lines from line ``start`` on match ``pattern`` (``re.search``); their matches."""
        rx = re.compile(pattern)
        found: list[re.Match] = []

        def enough() -> bool:
            found[:] = [m for line in list(self.lines[start:]) if (m := rx.search(line))]
            return len(found) >= count

        self.wait_line(None, f"{count} line(s) matching {pattern!r} after line {start}", timeout=timeout, until=enough)
        return found[:count]

    def wait_line(self, match, what: str, *, start: int = 0, timeout: float = 60.0, until=None) -> str:
        """Wait for the first line from line ``start`` on that ``match(line)`` accepts (or for ``until()``),
        failing with the output when the deadline passes or the process exits first."""
        deadline = time.monotonic() + timeout
        while True:
            exited = self.popen.poll() is not None  # read before the lines: its last lines are in by then
            if exited:
                self._reader.join(5)  # the pipe's last lines are in once the reader has seen its end
            if until is not None:
                if until():
                    return ""
            else:
                for line in list(self.lines[start:]):
                    if match(line):
                        return line
            if exited:
                raise AssertionError(
                    f"process exited ({self.popen.returncode}) before printing {what}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"process did not print {what} within {timeout} s:\n{self.output()}")
            time.sleep(0.02)  # ok-sleep: polling with a deadline


_ATTACH = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
pid = int(sys.argv[1])
if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
    sys.exit("ptrace: " + os.strerror(ctypes.get_errno()))
os.waitpid(pid, 0)
libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
"""
_ptrace: list[str] = []


def ptrace_refused() -> str | None:
    """Why this host refuses one process ptrace-attaching another of the same user that it did not start
    (as py-spy or gdb attach to a training job: yama's ptrace_scope, a container without CAP_SYS_PTRACE, a
    seccomp filter), or None when it allows it. Checked once, by trying it on a sleeping sibling."""
    if not _ptrace:
        victim = subprocess.Popen(["sleep", "30"], start_new_session=True)
        try:
            r = subprocess.run(
                [sys.executable, "-c", _ATTACH, str(victim.pid)], capture_output=True, text=True, timeout=30
            )
            _ptrace.append(r.stderr.strip() or f"the attach exited {r.returncode}" if r.returncode else "")
        finally:
            stop_groups([victim], grace=5)
    return _ptrace[0] or None


_FORKABLE = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
# What the interpreter, the C libraries and torch read from the environment when they are imported: a target
# whose environment differs from the fork server's here gets a real spawn (a fork has imported them already).
# TORCHELASTIC_* (a launcher's run id, read when the job asks) is not among them.
_IMPORT_TIME_ENV = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "CUDA", "NCCL", "LD_", "MALLOC")
_TORCH_SCRIPT = re.compile(rb"^(import torch\b|from torch\b)", re.M)
_ARGV_ROOM = 8192  # bytes of the server's argv area that a child's command line may fill (see forkserver.py)


class _Forked:
    """A target forked by the fork server, with the part of ``subprocess.Popen``'s interface the suite uses
    (``pid``, ``args``, ``stdout``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``,
    ``kill``). Its exit code comes from the server, which reaps it."""

    def __init__(self, pid: int, args: list, stdout, conn: socket.socket):
        self.pid, self.args, self.stdout, self._conn = pid, args, stdout, conn
        self.stderr = None
        self.returncode: int | None = None

    def _read_exit(self) -> None:
        data = self._conn.recv(64)
        self._conn.close()
        # no exit code: the server is gone (it outlives every child it forked unless it is killed)
        self.returncode = int(data) if data.strip() else -signal.SIGKILL

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_exit()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _ForkServer:
    """A fork server (tests/forkserver.py) that imported ``preload``, started on first use, when
    ``use_fork_server(True)`` turned it on (the suite's conftest does; benchmarks do not: they measure spawned
    processes). ``accepts(args)`` says which ``[python, script, ...]`` it may stand in for."""

    def __init__(self, preload: tuple, accepts):
        self.preload, self.accepts = preload, accepts
        self.enabled = False
        self.server: subprocess.Popen | None = None
        self.path = ""
        self.env: dict = {}
        self.failed = ""
        self.lock = threading.Lock()  # tests start ranks from threads: one server

    def _start_server(self) -> bool:
        with self.lock:
            return self._start_server_locked()

    def _start_server_locked(self) -> bool:
        if self.server is not None:
            return self.server.poll() is None
        if self.failed or not hasattr(os, "pidfd_open"):
            return False
        directory = tempfile.mkdtemp(prefix="pfs-", dir="/tmp")
        self.path = os.path.join(directory, "s")
        self.env = clean_env(directory)
        self.server = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "forkserver.py"), self.path, "-" * _ARGV_ROOM, *self.preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            start_new_session=True,
        )
        line = self.server.stdout.readline()  # the preload's import time; EOF if it failed
        if line.strip() != b"ready":
            self.failed = f"the fork server for {self.preload} did not start ({self.server.wait()}): spawning instead"
            print(self.failed, file=sys.stderr)
            return False
        return True

    def warm(self) -> None:
        """Start the server now, when enabled: it takes this process's environment as it starts, so a test that
        changes that environment for a while (``serving``) starts it first."""
        if self.enabled:
            self._start_server()

    def fits(self, args: list, env: dict) -> bool:
        """``[python, script, ...]`` that ``accepts`` takes, whose environment matches the server's where it is
        read at import time."""
        if not (self.enabled and len(args) >= 2 and args[0] == sys.executable):
            return False
        if len(b"\0".join(a.encode() for a in args)) >= _ARGV_ROOM or not self.accepts(args):
            return False
        if not self._start_server():
            return False

        def at_import(e: dict) -> dict:
            return {k: v for k, v in e.items() if k.startswith(_IMPORT_TIME_ENV) and not k.startswith("TORCHELASTIC_")}

        return at_import(env) == at_import(self.env)

    def start(self, args: list, env: dict, cwd: str, *, apart: bool = False, input: str | None = None):
        """Fork ``args`` (``[python, script, ...]``) from the server: a ``_Forked``, or None where a fork cannot
        stand in for a spawn (see ``fits``). Its stdin is ``input`` (or empty); its stdout and stderr one pipe
        (``stdout``), or two with ``apart`` (``stdout`` and ``stderr``)."""
        if not self.fits(args, env):
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out = os.pipe()
        err = os.pipe() if apart else (None, out[1])
        feed = os.pipe() if input else None
        stdin = feed[0] if feed else os.open(os.devnull, os.O_RDONLY)
        try:
            conn.connect(self.path)
            request = json.dumps({"argv": args[1:], "env": env, "cwd": cwd}).encode()
            fds = array.array("i", [stdin, out[1], err[1]])
            conn.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            pid = int(conn.recv(64))
        except (OSError, ValueError) as e:
            conn.close()
            for fd in (out[0], err[0], feed[1] if feed else None):
                if fd is not None:
                    os.close(fd)
            self.failed = f"the fork server for {self.preload} failed ({e}): spawning instead"
            print(self.failed, file=sys.stderr)
            return None
        finally:
            for fd in {out[1], err[1], stdin}:
                os.close(fd)
        if feed:
            threading.Thread(target=_feed, args=(feed[1], input.encode()), daemon=True).start()
        child = _Forked(pid, args, open(out[0], encoding=None), conn)
        child.stderr = open(err[0], encoding=None) if apart else None
        return child


def _feed(fd: int, data: bytes) -> None:
    try:
        with open(fd, "wb") as f:
            f.write(data)
    except OSError:  # the child did not read it all: as with subprocess.run, not an error
        pass


def _imports_torch(args: list) -> bool:
    """A ``.py`` script that imports torch at its top (one that does not is left a process without torch)."""
    if not args[1].endswith(".py"):
        return False
    try:
        with open(args[1], "rb") as f:
            return bool(_TORCH_SCRIPT.search(f.read()))
    except OSError:
        return False


def _is_probe_command(args: list) -> bool:
    """The ``probe`` console script beside this Python (a Python script run by this interpreter)."""
    return _PROBE_SCRIPT and args[1] == PROBE_BIN


# The targets' server has torch imported, and torch._dynamo (building any optimizer imports it); the probe
# command's has what a query and the doctor import.
_fork_server = _ForkServer(("torch", "torch._dynamo"), _imports_torch)
_cli_server = _ForkServer(
    (
        "duckdb",
        "sqlglot",
        "sqlglot.optimizer.qualify",
        "probe.cli",
        "probe.cli.query_runner",
        "probe.cli.doctor",
        "probe.cli.commands.query",
        "probe.cli.commands.doctor",
    ),
    _is_probe_command,
)


def use_fork_server(on: bool) -> None:
    """Start ``python SCRIPT.py`` targets that import torch, and the ``probe`` command, as forks of servers that
    imported torch (or the command's modules) once (tests/forkserver.py), where a fork can stand in for a spawn;
    off by default."""
    _fork_server.enabled = _cli_server.enabled = on


def _run(server: _ForkServer, args: list, env: dict, cwd: str, timeout: float, input: str | None):
    """``args`` forked from ``server`` and run to its end: its CompletedProcess (text, stdout and stderr apart),
    or None where the server cannot stand in for a spawn."""
    child = server.start(args, env, cwd, apart=True, input=input)
    if child is None:
        return None
    texts: dict = {}
    readers = [
        threading.Thread(target=lambda name=name, f=f: texts.__setitem__(name, f.read()), daemon=True)
        for name, f in (("stdout", child.stdout), ("stderr", child.stderr))
    ]
    for reader in readers:
        reader.start()
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(10)
        raise
    finally:
        for reader in readers:
            reader.join(10)
    return subprocess.CompletedProcess(args, child.returncode, texts.get("stdout", ""), texts.get("stderr", ""))


def _argv(args) -> list[str]:
    """``args`` (one path or a list) as strings; a ``.py`` first argument runs with this Python."""
    if isinstance(args, (str, Path)):
        args = [args]
    args = [str(a) for a in args]
    return [sys.executable, *args] if args[0].endswith(".py") else args


def start(args, env: dict, *, cwd=None, ready: str | None = "ready", timeout: float = 90.0, **popen) -> Proc:
    """Start ``args`` (a ``.py`` first argument runs with this Python) in its own process group, with
    ``env``, in ``cwd`` (default: the env's runtime dir); wait for a line containing ``ready``. With the fork
    server on (``use_fork_server``), a target script that imports torch is forked from it where it can be."""
    args = _argv(args)
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.STDOUT)
    cwd = str(cwd or env.get("PROBE_RUNTIME_DIR") or os.getcwd())
    p = _fork_server.start(args, env, cwd) if popen == _FORKABLE else None
    if p is None:
        p = subprocess.Popen(args, text=True, env=env, cwd=cwd, start_new_session=True, **popen)
    proc = Proc(p)
    if ready:
        try:
            proc.wait_for(ready, timeout)
        except BaseException:
            stop_groups([p], grace=5)
            raise
    return proc


def run_target(args, env: dict, *, cwd=None, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run a target to its end (as ``start`` does: a ``.py`` first argument runs with this Python, forked where
    it can be), stdin empty; its CompletedProcess (text, stdout and stderr apart). ``timeout`` is a deadline:
    past it the process is killed and ``subprocess.TimeoutExpired`` raised."""
    args = _argv(args)
    cwd = str(cwd or env.get("PROBE_RUNTIME_DIR") or os.getcwd())
    done = _run(_fork_server, args, env, cwd, timeout, None)
    if done is None:
        done = subprocess.run(
            args, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL
        )
    return done


class Spawner:
    """Start targets with ``env`` (see ``start``); ``close()`` stops them all (SIGCONT, SIGTERM, SIGKILL)."""

    def __init__(self, env: dict):
        self.env = env
        self.procs: list[Proc] = []

    def __call__(self, args, *, env=None, ready: str | None = "ready", timeout: float = 90.0, cwd=None) -> Proc:
        e = dict(self.env)
        e.update(env or {})
        proc = start(args, e, cwd=cwd or self.env["PROBE_RUNTIME_DIR"], ready=None)  # a test may point env's elsewhere
        self.procs.append(proc)  # before waiting: a target that never gets ready is still stopped by close()
        if ready:
            proc.wait_for(ready, timeout)
        return proc

    def close(self) -> None:
        stop_groups([proc.popen for proc in self.procs], grace=5)


def run_probe(*args, env: dict, timeout: float = 180.0, input: str | None = None) -> subprocess.CompletedProcess:
    """Run the real ``probe`` command; its CompletedProcess (text). The timeout is a deadline, not a speed
    limit: a call that hangs fails, one slowed by a busy host does not."""
    argv = [PROBE_BIN, *map(str, args)]
    done = _run(_cli_server, [sys.executable, *argv], env, os.getcwd(), timeout, input)
    if done is None:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, input=input)
    return done


class Recorder:
    """A TCP listener on loopback (``port``, 0: any free one) standing where a probe should be: it records each
    connection's request head (what the client sent up to its blank line, or until it closed) in ``got`` and
    answers ``reply``, or closes without a word."""

    def __init__(self, port: int = 0, reply: bytes | None = None):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        self.got: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                        data += chunk
                    self.got.append(data)
                    if self.reply is not None:
                        conn.sendall(self.reply)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def registry_entry(pid: int, env: dict) -> dict:
    """The registry entry process ``pid`` wrote in ``env``'s runtime dir."""
    with open(f"{env['PROBE_RUNTIME_DIR']}/{pid}.json") as f:
        return json.load(f)


def exchange(path_or_addr, payload: bytes, timeout: float = 60.0) -> bytes:
    """Send ``payload`` on a fresh connection (a unix socket path, or a ``(host, port)`` address) and read the
    answer to its end: what a client the CLI would never be sends."""
    family = socket.AF_UNIX if isinstance(path_or_addr, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path_or_addr)
        s.sendall(payload)
        chunks = []
        while chunk := s.recv(1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)


def post(path_or_addr, route: str, body: bytes, extra: str = "") -> tuple[int, dict]:
    """One raw ``POST route`` (``extra``: more header lines, each ending in CRLF): (status, JSON body)."""
    head = f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
    data = exchange(path_or_addr, head + body)
    return int(data.split(b" ", 2)[1]), json.loads(data.partition(b"\r\n\r\n")[2] or b"{}")


def query_json(cli, target, sql: str, *args: str) -> list[dict]:
    """The rows of ``probe TARGET --format json query [ARGS] SQL`` run by ``cli`` (the conftest's fixture),
    which must succeed."""
    r = cli(str(target), "--format", "json", "query", *args, sql)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def max_step(cli, target) -> int:
    """The last step ``target`` recorded in torch.steps (0 before its first)."""
    return query_json(cli, target, "SELECT max(step) AS step FROM torch.steps")[0]["step"] or 0


def last_step(proc: Proc) -> int:
    """The last ``step N`` line a target printed (-1 before its first)."""
    return max((int(m) for m in re.findall(r"^step (\d+)", proc.output(), re.M)), default=-1)


def steps_on(proc: Proc, after: int | None = None, timeout: float = 60.0) -> bool:
    """Whether a target that prints ``step N`` lines, still running, prints three steps past ``after`` (default:
    its last step now) within ``timeout`` seconds."""
    after = last_step(proc) if after is None else after
    return bool(poll(lambda: proc.popen.poll() is None and last_step(proc) > after + 2, timeout))


def audit_records(env: dict) -> list[dict]:
    """The audit log's records in ``env``'s runtime dir ([] before the first action wrote one)."""
    try:
        with open(os.path.join(env["PROBE_RUNTIME_DIR"], "audit.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def other_uid() -> int:
    """A uid no account uses: another local user (root can become any uid without an account)."""
    import pwd

    used = {p.pw_uid for p in pwd.getpwall()}
    return next(u for u in range(47000, 60000) if u not in used)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:  # already gone
        pass


def stop_groups(popens: list, grace: float = 10.0) -> None:
    """Stop each Popen's process group (started with ``start_new_session=True``): SIGCONT for the
    stopped ones, SIGTERM to every group first, then SIGKILL to the groups that outlive ``grace`` seconds."""
    live = [p for p in popens if p.poll() is None]
    for p in live:
        _signal_group(p.pid, signal.SIGCONT)
        _signal_group(p.pid, signal.SIGTERM)
    for p in live:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            _signal_group(p.pid, signal.SIGKILL)
            p.wait(5)


# -- probe's agent in this process -----------------------------------------------------------------------
class InProcess:
    """probe's agent served from this process (``serving``): ``pid`` (this process's) and ``entry`` (its registry
    entry: socket, tcp_port, key, ...), as a client finds them; the same two names a started target has."""

    def __init__(self, entry: dict):
        self.pid = os.getpid()
        self.entry = entry


def process_state(runtime_dir: str) -> dict:
    """What a start of the probe could change in this process, as comparable values: threads, signal handlers and
    the wakeup fd, atexit entries, exception hooks, faulthandler, the ``PROBE*`` and ``TORCH*`` environment, and
    this process's files in ``runtime_dir``."""
    import atexit
    import faulthandler

    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    mine = f"{os.getpid()}."
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "signal handlers": {
            s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)
        },
        "wakeup fd": fd,
        "atexit entries": atexit._ncallbacks(),
        "exception hooks": [repr(sys.excepthook), repr(threading.excepthook)],
        "faulthandler": faulthandler.is_enabled(),
        "environment": sorted((k, v) for k, v in os.environ.items() if k.startswith(("PROBE", "TORCH"))),
        "files": sorted(f for f in os.listdir(runtime_dir) if mine in f) if os.path.isdir(runtime_dir) else [],
    }


@contextmanager
def serving(env: dict, **settings: str):
    """probe's agent (``probe.start()``: its server threads and session) started in this process on ``env``'s
    runtime dir, with ``settings`` (``PROBE_PORT="0"``, ...) in this process's environment while it serves; yields
    an ``InProcess``. On exit it is stopped and the settings taken out again, and an AssertionError names what
    the stop left behind (threads get a few seconds to end)."""
    import probe
    from probe.agent import lifecycle  # noqa: F401  (its one atexit and at-fork registration is made at import)

    rdir = env["PROBE_RUNTIME_DIR"]
    _cli_server.warm()  # before the agent sets TORCH_FR_BUFFER_SIZE here: else no command could be forked from it
    before = process_state(rdir)
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        probe.start(runtime=rdir)
        yield InProcess(registry_entry(os.getpid(), env))
    finally:
        probe.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    left: dict = {}

    def clean() -> bool:
        after = process_state(rdir)
        left.clear()
        left.update({k: [before[k], after[k]] for k in before if before[k] != after[k]})
        return not left

    assert poll(clean, timeout=10, interval=0.05), f"stopping the probe left behind: {left}"
