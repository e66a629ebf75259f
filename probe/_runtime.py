"""The per-user runtime directory and the registry of probed processes.

Layout of the directory (mode 0700, owned by the user)::

    <pid>.sock     the unix socket of the probe in process <pid>
    <pid>.json     its registry entry (mode 0600): identity, endpoints, token
    audit.jsonl    every action and eval, one JSON object a line
    hang-<pid>.txt stacks written by the hang watchdog (read back by offline_status)

With ``PROBE_REGISTRY`` set, entries are also written to that shared directory so
ranks on other nodes can be found.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import sys

from ._config import setting
from ._errors import EndpointError

__all__ = ["runtime_dir", "rank_identity", "write_entry", "read_entries", "remove_entry", "pid_alive",
           "shared_registry", "job_token", "registry_listen", "offline_status"]


def runtime_dir(create: bool = True) -> str:
    """The directory for sockets and registry entries of this user, created 0700."""
    path = setting("PROBE_RUNTIME_DIR")
    if not path:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        path = os.path.join(xdg, "probe") if xdg and os.path.isdir(xdg) else f"/tmp/probe-{os.getuid()}"
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
        if st.st_uid != os.getuid():
            raise EndpointError(
                f"The runtime directory {path} belongs to another user; set PROBE_RUNTIME_DIR to a directory of your own."
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, 0o700)
    return path


def _int_env(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                continue
    return None


def rank_identity() -> dict:
    """Rank, local rank, world size and node rank: torchrun's variables, else SLURM's, else Open MPI's."""
    return {
        "rank": _int_env("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"),
        "local_rank": _int_env("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"),
        "world_size": _int_env("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"),
        "node_rank": _int_env("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"),
        "host": socket.gethostname(),
    }


def shared_registry() -> str | None:
    """The shared registry directory (PROBE_REGISTRY), created 0700 when missing; None when unset."""
    path = setting("PROBE_REGISTRY")
    if not path:
        return None
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def job_token() -> str:
    """The token every rank of the job listens with: PROBE_TOKEN, else one shared through the registry.

    The first rank to get here creates ``<PROBE_REGISTRY>/token`` (mode 0600, written
    to a temporary file and linked into place, so no rank ever reads half a token);
    the others, on any node that mounts the directory, read the same one.
    """
    import secrets

    token = setting("PROBE_TOKEN")
    if token:
        return token
    shared = shared_registry()
    if shared is None:
        return secrets.token_urlsafe(24)
    path = os.path.join(shared, "token")
    tmp = f"{path}.{socket.gethostname()}-{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(24))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    with open(path) as f:
        return f.read().strip()


def registry_listen(host: str | None, token: str | None) -> tuple[str, str, str]:
    """(port, bind address, token) for a rank that must be reachable through PROBE_REGISTRY.

    A free port, every interface unless PROBE_HOST is set, and the job's token.
    """
    bind = host or (os.environ.get("PROBE_HOST") or "0.0.0.0")
    return "0", bind, token or job_token()


def _atomic_write(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _entry_dirs() -> list[str]:
    dirs = [runtime_dir()]
    shared = shared_registry()
    if shared:
        dirs.append(shared)
    return dirs


def write_entry(entry: dict) -> None:
    """Write (or rewrite) the registry entry of this process, locally and in the shared registry."""
    local, *shared = _entry_dirs()
    _atomic_write(os.path.join(local, f"{entry['pid']}.json"), entry)
    for d in shared:
        _atomic_write(os.path.join(d, f"{entry['host']}-{entry['pid']}.json"), dict(entry, shared=True))


def remove_entry(pid: int, host: str | None = None) -> None:
    host = host or socket.gethostname()
    try:
        dirs = _entry_dirs()
    except Exception:
        return
    for i, d in enumerate(dirs):
        name = f"{pid}.json" if i == 0 else f"{host}-{pid}.json"
        for path in (os.path.join(d, name), os.path.join(d, f"{pid}.sock") if i == 0 else None):
            if path:
                try:
                    os.unlink(path)
                except OSError:
                    pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_entries(clean: bool = False) -> list[dict]:
    """Live registry entries of this host (and of the shared registry), sorted by rank then pid.

    Entries whose pid is gone are skipped, and deleted when ``clean`` is true.
    """
    entries: dict[tuple, dict] = {}
    here = socket.gethostname()
    for d in _entry_dirs():
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if not name.endswith(".json"):
                continue
            path = os.path.join(d, name)
            try:
                with open(path) as f:
                    entry = json.load(f)
            except (OSError, ValueError):
                continue
            if not isinstance(entry, dict) or "pid" not in entry:
                continue
            if entry.get("host", here) == here and not pid_alive(int(entry["pid"])):
                if clean:
                    for stale in (path, entry.get("socket")):
                        try:
                            if stale:
                                os.unlink(stale)
                        except OSError:
                            pass
                continue
            key = (entry.get("host"), entry["pid"])
            if key not in entries or not entry.get("shared"):
                entries[key] = entry
    return sorted(entries.values(), key=lambda e: (e.get("rank") is None, e.get("rank") or 0, e["pid"]))


def process_argv() -> list[str]:
    """This process's argv from /proc (usable before ``sys.argv`` is set), else sys.argv."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            parts = f.read().split(b"\0")
        return [p.decode(errors="replace") for p in parts if p]
    except OSError:
        return list(getattr(sys, "argv", []) or [])


def offline_status(entry: dict) -> dict:
    """What the dump file says about a process whose server does not answer (the GIL held in C).

    Read by the CLI from the runtime directory: a dump written after the process
    started means the watchdog fired; ``hung_since`` is the firing time minus the
    timeout from faulthandler's ``Timeout (H:MM:SS)!`` header, i.e. the last step.
    """
    try:
        path = os.path.join(runtime_dir(create=False), f"hang-{int(entry['pid'])}.txt")
        st = os.stat(path)
        if st.st_size == 0 or st.st_mtime < float(entry.get("started_at") or 0):
            return {}
        with open(path, "rb") as f:
            f.seek(max(0, st.st_size - 65536))
            tail = f.read().decode(errors="replace")
    except (OSError, KeyError, ValueError, TypeError):
        return {}
    stamps = re.findall(r"Timeout \((\d+):(\d\d):(\d\d)(?:\.\d+)?\)!", tail)
    timeout = 0.0
    if stamps:
        h, m, s = stamps[-1]
        timeout = int(h) * 3600 + int(m) * 60 + int(s)
    return {"state": "hung", "hung_since": st.st_mtime - timeout, "hang_dump": path}
