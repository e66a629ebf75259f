"""Start and stop the probe inside this process: one ``Session`` owns all it installs.

``start()`` makes the session: it binds the unix socket (and TCP when asked), writes the
registry entry, serves on daemon threads, and installs the torch hooks (through
``probe.training``), the hang watchdog, the post-mortem hooks and the SIGTERM handler. Each
step pushes its own undo; ``stop()`` runs them in reverse, so it removes exactly what this
start put in, and so does interpreter exit (records, sockets and entry only: the process is going). On
SIGTERM the session's ``SigtermGuard`` (``watchdog``) writes the record and stops it the same way.
Starting twice is harmless. A forked child (a DataLoader worker) does not inherit a running
probe: threads do not survive fork, so the child drops the session.
"""

from __future__ import annotations

import atexit
import os
import secrets
import sys
import threading
import time
from typing import Callable

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
from ..actions import guard, queue
from ..actions.maintenance import stop_profile
from ..postmortem import hooks as postmortem
from ..tables import registry as tables
from ..util.errorlog import record_error
from ..util.handshake import is_loopback
from ..util.procfs import proc_start
from ..training import frameworks, hooks
from . import action_routes  # noqa: F401  (registers the action and eval routes)
from . import routes  # noqa: F401  (registers the read routes and GET /profile)
from .._core import state
from .._core.state import info
from .snapshot import reset_lanes
from .listeners import TCPServer, UnixServer, close, serve_in_thread, stop_serving
from .watchdog import SigtermGuard, Watchdog


_lock = threading.RLock()
_session: Session | None = None  # the running one


def is_running() -> bool:
    return _session is not None


def start(
    *, port: int | None = None, host: str | None = None, token: str | None = None, runtime: str | None = None
) -> dict:
    """Start the probe server in this process; return its registry entry. Starting twice is harmless."""
    global _session
    with _lock:
        if _session is None:
            session = Session()
            session.start(port=port, host=host, token=token, runtime=runtime)
            _session = session
        return info()


def stop(*, exiting: bool = False) -> None:
    """Stop serving and undo what ``start`` did: hooks, threads, handlers, the registry entry and socket.

    ``exiting`` (interpreter exit, SIGTERM): only close the listening sockets and remove the entry and the
    hooks that write records; the serving threads are daemons that end with the interpreter, and Python 3.12+
    refuses to start the thread a graceful shutdown needs at that point.
    """
    global _session
    with _lock:
        session, _session = _session, None
        if session is not None:
            session.stop(exiting=exiting)


class Session:
    """One running probe: what ``start`` installed, each with its undo, undone in reverse by ``stop``."""

    def __init__(self):
        self._undo: list[tuple[Callable[[], None], bool]] = []  # (undo, whether it runs when the process exits)
        self.watchdog: Watchdog | None = None
        self.sigterm: SigtermGuard | None = None

    def _did(self, undo: Callable[[], None], at_exit: bool = False) -> None:
        self._undo.append((undo, at_exit))

    def start(self, *, port=None, host=None, token=None, runtime=None) -> None:
        try:
            self._start(port, host, token, runtime)
        except BaseException:
            self.stop()
            raise

    def _start(self, port, host, token, runtime) -> None:
        if runtime:
            previous = os.environ.get("PROBE_RUNTIME_DIR")
            os.environ["PROBE_RUNTIME_DIR"] = runtime
            self._did(lambda: _restore_env("PROBE_RUNTIME_DIR", previous))
        try:
            rdir = runtime_dir()
        except (ProbeError, OSError) as exc:  # someone else's, a symlink, unwritable: never fatal, never repaired
            rdir = use_private_dir(getattr(exc, "message", None) or f"the runtime directory is unusable ({exc})")
        sweep_stale(rdir)
        sock_path = os.path.join(rdir, f"{os.getpid()}.sock")
        self._did(reset_lanes)  # the readers' pace and slots, made from this start's settings at first use
        self._serve(UnixServer(sock_path), "probe-server")

        port_setting = port if port is not None else setting("PROBE_PORT")
        tcp = tcp_host = None
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
                raise ProbeError(
                    f"probe could not listen on {tcp_host}:{port_setting} ({exc}); choose another PROBE_PORT or use 0 "
                    "for a free port."
                ) from None
            self._serve(tcp, "probe-server-tcp")
            if not is_loopback(tcp_host):
                print(
                    f"[probe] WARNING: listening on {tcp_host}:{tcp.server_address[1]}, reachable from other hosts; "
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
            "tcp_port": tcp.server_address[1] if tcp else None,
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
        if tcp is not None:
            entry["key"] = tcp.key  # this rank's key only: it opens no other rank of the job (probe.util.handshake)
        tables.load_builtins()  # now: a query, or the record written as the interpreter exits, imports nothing
        write_entry(entry)
        state.set_entry(entry)
        self._did(lambda: (state.clear(), remove_entry(entry["pid"], entry.get("host"))), at_exit=True)
        # the training loop, through probe.training: the flight recorder on before the first process group (the
        # torch.collectives table), torch's step and module hooks now or when torch gets imported
        if frameworks.enable():
            self._did(frameworks.disable)
        hooks.arm()
        self._did(hooks.disarm)
        self._did(queue.drop_pending)  # an action still waiting for a step boundary never runs
        self._did(stop_profile)  # nor does a profile of the next steps
        guard.arm_from_setting()  # PROBE_GUARD: the guard, armed at the first step boundary
        self._did(guard.stand_down)  # and any guard armed since, its wrappers and hook taken out
        self.watchdog = Watchdog.start()  # PROBE_HANG_TIMEOUT: all-thread stacks on disk when steps stop
        if self.watchdog is not None:
            state.add_status_provider(self.watchdog.status)
            self._did(self.watchdog.stop, at_exit=True)
        postmortem.install()  # a record in the runtime dir when the process dies, and periodic snapshots
        self._did(postmortem.uninstall, at_exit=True)
        self.sigterm = SigtermGuard.install(stop)  # the record on SIGTERM, and death as prompt as without the probe
        if self.sigterm is not None:
            self._did(self.sigterm.uninstall)

    def _serve(self, server, name: str) -> None:
        thread = serve_in_thread(server, name)
        self._did(lambda: close(server), at_exit=True)
        self._did(lambda: stop_serving(server, thread))

    def stop(self, *, exiting: bool = False) -> None:
        """Run every undo, last first (at interpreter exit only those marked for it); each one that fails is
        recorded and the others still run."""
        while self._undo:
            undo, at_exit = self._undo.pop()
            if exiting and not at_exit:
                continue
            try:
                undo()
            except Exception as exc:
                record_error("stopping the probe", exc)

    # a forked child (a DataLoader worker) keeps nothing of the parent's session: its threads did not survive
    def before_fork(self) -> None:
        if self.watchdog is not None:
            self.watchdog.before_fork()

    def after_fork_in_parent(self) -> None:
        if self.watchdog is not None:
            self.watchdog.after_fork_in_parent()

    def after_fork_in_child(self) -> None:
        if self.watchdog is not None:
            self.watchdog.after_fork_in_child()
        if self.sigterm is not None:
            self.sigterm.after_fork_in_child()
        state.clear()


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _at_exit() -> None:
    """Interpreter exit with a session: the post-mortem ``exit`` record, then the sockets and the entry."""
    if _session is None:
        return
    try:
        postmortem.at_exit()
        stop(exiting=True)
    except Exception:
        pass  # nothing may raise at the user's interpreter exit


def _fork_hook(name: str) -> Callable[[], None]:
    def run() -> None:
        session = _session
        if session is not None:
            getattr(session, name)()

    return run


def _drop_in_child() -> None:
    global _session
    session, _session = _session, None
    if session is not None:
        session.after_fork_in_child()


# one registration each for the life of the interpreter (at-fork hooks cannot be removed, and an atexit entry
# taken out leaves its slot): without a session they do nothing
atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_fork_hook("before_fork"),
        after_in_parent=_fork_hook("after_fork_in_parent"),
        after_in_child=_drop_in_child,
    )
