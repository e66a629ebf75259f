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
from typing import Callable

from . import __version__
from ._config import setting
from ._errors import ProbeError
from ._runtime import process_argv, rank_identity, registry_listen, remove_entry, runtime_dir, write_entry

__all__ = ["start", "stop", "is_running", "info", "add_status_provider", "status"]

_lock = threading.RLock()
_state: dict = {}
_status_providers: list[Callable[[], dict]] = []


def is_running() -> bool:
    return bool(_state)


def info() -> dict:
    """The registry entry of this process (a copy), or {} when the probe is not running."""
    return dict(_state.get("entry", {}))


def add_status_provider(fn: Callable[[], dict]) -> None:
    """Add fields to ``/health`` and ``probe list`` (e.g. the step counter); never raises into callers."""
    if fn not in _status_providers:
        _status_providers.append(fn)


def status() -> dict:
    from ._health import record_error

    out = info()
    out.pop("token", None)
    out["uptime_s"] = time.time() - out.get("started_at", time.time())
    for fn in list(_status_providers):
        try:
            out.update(fn() or {})
        except Exception as exc:
            record_error("status provider", exc)
    return out


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def start(*, port: int | None = None, host: str | None = None, token: str | None = None,
          runtime: str | None = None) -> dict:
    """Start the probe server in this process; return its registry entry. Starting twice is harmless."""
    with _lock:
        if _state:
            return info()
        if runtime:
            os.environ["PROBE_RUNTIME_DIR"] = runtime
        from . import _routes  # noqa: F401  (registers the HTTP routes)
        from . import _actions_routes  # noqa: F401  (guarded actions and eval)
        from ._server import TCPServer, UnixServer, serve_in_thread

        rdir = runtime_dir()
        sock_path = os.path.join(rdir, f"{os.getpid()}.sock")
        servers = [UnixServer(sock_path)]
        threads = [serve_in_thread(servers[0], "probe-server")]

        port_setting = port if port is not None else setting("PROBE_PORT")
        tcp_port = tcp_host = None
        token = token or setting("PROBE_TOKEN")
        if port_setting in (None, "") and setting("PROBE_REGISTRY"):  # other nodes find this rank there
            port_setting, host, token = registry_listen(host, token)
        if port_setting not in (None, ""):
            tcp_host = host or setting("PROBE_HOST")
            token = token or secrets.token_urlsafe(24)
            try:
                tcp = TCPServer(tcp_host, int(port_setting), token)
            except (OSError, ValueError) as exc:
                servers[0].server_close()
                raise ProbeError(f"probe could not listen on {tcp_host}:{port_setting} ({exc}); choose another PROBE_PORT or use 0 for a free port.") from None
            tcp_port = tcp.server_address[1]
            servers.append(tcp)
            threads.append(serve_in_thread(tcp, "probe-server-tcp"))
            if not _loopback(tcp_host):
                print(f"[probe] WARNING: listening on {tcp_host}:{tcp_port}, reachable from other hosts; "
                      "every request needs the token.", file=sys.stderr, flush=True)

        entry = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            **rank_identity(),
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
            "uid": os.getuid(),
        }
        if tcp_port is not None:
            entry["token"] = token
        write_entry(entry)
        _state.update(entry=entry, servers=servers, threads=threads)
        from ._torch_hooks import arm as _arm_torch

        _arm_torch()  # torch's step and module hooks: now, or when torch gets imported
        from ._watchdog import install as _install_watchdog

        _install_watchdog()  # PROBE_HANG_TIMEOUT: all-thread stacks on disk when steps stop
        return info()


def stop(*, exiting: bool = False) -> None:
    """Stop serving and remove this process's registry entry and socket.

    ``exiting`` (interpreter exit): only close the listening sockets; the serving threads are
    daemons that end with the interpreter, and Python 3.12+ refuses to start the thread a
    graceful shutdown needs at that point.
    """
    with _lock:
        if not _state:
            return
        servers = _state.get("servers", [])
        entry = _state.get("entry", {})
        _state.clear()
    try:
        if "probe._watchdog" in sys.modules:
            sys.modules["probe._watchdog"].uninstall()  # no hang dumps for a process we stopped probing
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
    _state.clear()


atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
