"""A fork server for the processes the suite starts: their imports made once per test worker, each process a fork.

Every target script the suite starts imports torch and builds an optimizer, which imports ``torch._dynamo``:
~2.2 s of CPU per process before its first line of training, ~275 times a run on a 2-core host; every ``probe``
call imports duckdb and sqlglot, ~800 times. A server imports the modules it is given once, then forks a child
per request that becomes ``python SCRIPT ARGS...`` (a target script, or the ``probe`` console script) as
closely as a fork can: its own session, the requested stdin/stdout/stderr, working directory, environment
(``os.environ`` and the C environment), ``sys.argv``/``sys.orig_argv``, ``sys.path[0]``, a fresh ``__main__``
module, the ``probe-autostart.pth`` hook that ``site`` runs at start-up (for ``PROBE=1``), only fds 0-2 open,
and its ``/proc/PID/cmdline`` rewritten in place (the server's own argv area is padded for it, as
``setproctitle`` does), so ``probe`` reads the target's command line as it would a spawned one's. The harness
(``tests/harness.py``) starts the servers and falls back to a real spawn for what a fork cannot reproduce: an
environment that differs where the interpreter or the preloaded modules read it at import time.

Protocol (a unix seqpacket socket, one connection per child): the client sends one JSON request with three
fds (SCM_RIGHTS: stdin, stdout, stderr); the server answers the child's pid, and, when the child has exited
and been reaped, its exit code (``os.waitstatus_to_exitcode``: ``-N`` for a signal), then closes the
connection. The server exits when its stdin reaches end of file (the test worker that started it is gone).

    python tests/forkserver.py SOCKET_PATH PADDING MODULE...
"""

from __future__ import annotations

import array
import builtins
import ctypes
import json
import os
import selectors
import socket
import sys
import types

MAX_REQUEST = 1 << 20


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancdata, _flags, _addr = conn.recvmsg(MAX_REQUEST, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return json.loads(data), list(fds)


def serve(listener: socket.socket) -> tuple[dict, list[int]] | None:
    """Fork a child per request. Returns in a child only (its request and fds); in the server, returns None
    when the worker that started it is gone."""
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(0, selectors.EVENT_READ, "lifeline")
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    while True:
        for key, _ in sel.select():
            if key.data == "lifeline":
                if not os.read(0, 4096):
                    return None
            elif key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _recv_request(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    conn.close()
                    for pidfd, (_pid, other) in children.items():
                        os.close(pidfd)
                        other.close()
                    return request, fds
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, conn)
                sel.register(pidfd, selectors.EVENT_READ, "child")
                _send(conn, f"{pid}\n")
            else:
                pid, conn = children.pop(key.fd)
                sel.unregister(key.fd)
                os.close(key.fd)
                _pid, status = os.waitpid(pid, 0)
                _send(conn, f"{os.waitstatus_to_exitcode(status)}\n")
                conn.close()


def _send(conn: socket.socket, text: str) -> None:
    try:
        conn.sendall(text.encode())
    except OSError:  # the client gave up on this child; the server goes on
        pass


def _rewrite_cmdline(argv: list[str]) -> None:
    """Write ``argv`` over this process's argv area (``/proc/self/stat`` fields 48-49), NUL-padded, so
    ``/proc/PID/cmdline`` reads it; a longer one than the area is cut (the client checks it fits)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])
    except (OSError, IndexError, ValueError):  # a kernel without them (before 3.5): the server's stays
        return
    data = b"".join(a.encode() + b"\0" for a in argv)[: end - start - 1]
    ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)


def become(request: dict, fds: list[int]) -> types.ModuleType:
    """Turn this fork into ``python SCRIPT ARGS...`` (see the module's docstring); its ``__main__`` module,
    ready to run."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") > 0 else 4096)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    path = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.orig_argv = [sys.executable, *argv]
    sys.path[0] = os.path.dirname(path)
    _rewrite_cmdline(sys.orig_argv)
    for entry in sys.path:  # what site ran at start-up, now with the target's environment
        pth = os.path.join(entry, "probe-autostart.pth")
        if os.path.isfile(pth):
            with open(pth) as f:
                for line in f:
                    if line.startswith(("import ", "import\t")):
                        exec(line)
            break
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    main.__cached__ = None
    from importlib.machinery import SourceFileLoader

    main.__loader__ = SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    return main


def run(main: types.ModuleType) -> None:
    """Run the target's code as ``__main__``; an exception it does not catch is printed without this file's
    frames and exits 1, as the interpreter would (KeyboardInterrupt goes on up: its exit is a SIGINT)."""
    with open(main.__file__, "rb") as f:
        code = compile(f.read(), main.__file__, "exec")
    try:
        exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001  (the interpreter's own top level)
        sys.excepthook(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        sys.exit(1)


if __name__ == "__main__":
    for name in sys.argv[3:]:
        __import__(name)
    os.close(os.pidfd_open(os.getpid()))  # a kernel without pidfds (before 5.3) fails here: the harness spawns
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(sys.argv[1])
    listener.listen(64)
    print("ready", flush=True)
    child = serve(listener)
    if child is None:
        sys.exit(0)
    run(become(*child))
