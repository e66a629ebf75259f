"""Start and stop the probe inside this process.

``start()`` binds the unix socket (and TCP when asked), writes the registry entry,
and serves on daemon threads; it is idempotent. ``stop()`` undoes all of it, and so
does interpreter exit. A forked child (a DataLoader worker) does not inherit a
running probe: threads do not survive fork, so the child's state is reset.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import secrets
import socket
import sys
import threading
import time

from .. import __version__
from ..config import setting
from .._errors import ProbeError
from .._identity import job_identity, process_argv, rank_identity
from .._runtime import (
    registry_listen,
    remove_entry,
    runtime_dir,
    shared_registry,
    sweep_stale,
    use_private_dir,
    write_entry,
)
from ..actions import guard
from ..postmortem import hooks as postmortem
from ..tables import registry as tables
from ..util.procfs import proc_start
from ..training import frameworks, hooks
from . import action_routes  # noqa: F401  (registers the action and eval routes)
from . import profile  # noqa: F401  (registers GET /profile, the stack sampler)
from . import routes  # noqa: F401  (registers the read routes)
from . import snapshot  # noqa: F401  (the query path, loaded at start: never in a training step later)
from . import sigterm, watchdog
from .._core import state
from .listeners import TCPServer, UnixServer, serve_in_thread
from .._core.state import info

__all__ = ["start", "stop", "is_running", "info"]

_lock = threading.RLock()
_running: dict = {}  # servers and threads of the running probe; the entry itself lives in state


def is_running() -> bool:
    return bool(_running)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def start(
    *, port: int | None = None, host: str | None = None, token: str | None = None, runtime: str | None = None
) -> dict:
    """Start the probe server in this process; return its registry entry. Starting twice is harmless."""
    with _lock:
        if _running:
            return info()
        if runtime:
            os.environ["PROBE_RUNTIME_DIR"] = runtime
        try:
            rdir = runtime_dir()
        except (ProbeError, OSError) as exc:  # someone else's, a symlink, unwritable: never fatal, never repaired
            rdir = use_private_dir(getattr(exc, "message", None) or f"the runtime directory is unusable ({exc})")
        sweep_stale(rdir)
        sock_path = os.path.join(rdir, f"{os.getpid()}.sock")
        servers = [UnixServer(sock_path)]
        threads = [serve_in_thread(servers[0], "probe-server")]

        port_setting = port if port is not None else setting("PROBE_PORT")
        tcp_port = tcp_host = None
        token = token or setting("PROBE_TOKEN")
        # other nodes find this rank in the shared registry: only one this user alone can write (else refused, said
        # once)
        if port_setting in (None, "") and setting("PROBE_REGISTRY") and shared_registry():
            port_setting, host, token = registry_listen(host, token)
        if port_setting not in (None, ""):
            tcp_host = host or setting("PROBE_HOST")
            token = token or secrets.token_urlsafe(24)
            try:
                tcp = TCPServer(tcp_host, int(port_setting), token, rank_identity()["rank"])
            except (OSError, ValueError) as exc:
                servers[0].server_close()
                raise ProbeError(
                    f"probe could not listen on {tcp_host}:{port_setting} ({exc}); choose another PROBE_PORT or use 0 "
                    "for a free port."
                ) from None
            tcp_port = tcp.server_address[1]
            servers.append(tcp)
            threads.append(serve_in_thread(tcp, "probe-server-tcp"))
            if not _loopback(tcp_host):
                print(
                    f"[probe] WARNING: listening on {tcp_host}:{tcp_port}, reachable from other hosts; "
                    "every request needs the token.",
                    file=sys.stderr,
                    flush=True,
                )

        entry = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            **rank_identity(),
            "job": job_identity(),
            "socket": sock_path,
            "tcp_host": tcp_host,
            "tcp_port": tcp_port,
            "argv": process_argv(),
            "cwd": os.getcwd(),
            "python": sys.version.split()[0],
            "executable": sys.executable,
            "torch": getattr(sys.modules.get("torch"), "__version__", None),
            "probe": __version__,
            "started_at": time.time(),
            "proc_start": proc_start(),  # the kernel's start time: a later process given the same pid is not this one
            "uid": os.getuid(),
        }
        if tcp_port is not None:
            entry["key"] = tcp.key  # this rank's key only: it opens no other rank of the job (probe.util.handshake)
        tables.load_builtins()  # now: a query, or the record written as the interpreter exits, imports nothing
        write_entry(entry)
        state.set_entry(entry)
        _running.update(servers=servers, threads=threads)
        frameworks.enable()  # torch.collectives: the flight recorder must be on before the first process group
        hooks.arm()  # torch's step and module hooks: now, or when torch gets imported
        guard.arm_from_setting()  # PROBE_GUARD: the guard, armed at the first step boundary
        watchdog.install()  # PROBE_HANG_TIMEOUT: all-thread stacks on disk when steps stop
        postmortem.install()  # a record in the runtime dir when the process dies, and periodic snapshots
        sigterm.install(stop)  # the record on SIGTERM, and death as prompt as without the probe
        return info()


def stop(*, exiting: bool = False) -> None:
    """Stop serving and remove this process's registry entry and socket.

    ``exiting`` (interpreter exit): only close the listening sockets; the serving threads are
    daemons that end with the interpreter, and Python 3.12+ refuses to start the thread a
    graceful shutdown needs at that point.
    """
    with _lock:
        if not _running:
            return
        servers = _running.get("servers", [])
        entry = state.info()
        _running.clear()
        state.clear()
    try:
        watchdog.uninstall()  # no hang dumps for a process we stopped probing
        postmortem.uninstall()
        for srv in servers:
            if exiting:
                try:
                    srv.server_close()
                except OSError:
                    pass
            else:
                _shutdown(srv)
    finally:
        remove_entry(entry.get("pid", os.getpid()), entry.get("host"))


def _at_exit() -> None:
    try:
        stop(exiting=True)
    except Exception:
        pass  # nothing may raise at the user's interpreter exit


def _shutdown(srv) -> None:
    """serve_forever sleeps in select with a long timeout (no idle wake-ups); wake it to stop."""
    t = threading.Thread(target=srv.shutdown, daemon=True)
    t.start()
    try:
        addr = srv.server_address
        if isinstance(addr, str):
            s = socket.socket(socket.AF_UNIX)
        else:
            s = socket.socket(srv.address_family)
            if addr[0] in ("0.0.0.0", "::"):
                addr = ("127.0.0.1" if srv.address_family == socket.AF_INET else "::1", addr[1])
        s.settimeout(1)
        s.connect(addr)
        s.close()
    except OSError:
        pass
    t.join(2)
    try:
        srv.server_close()
    except OSError:
        pass


def _after_fork_in_child() -> None:
    _running.clear()
    state.clear()


atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
