"""The per-user runtime directory and the registry of probed processes.

Layout of the directory (mode 0700, owned by the user)::

    <pid>.sock     the unix socket of the probe in process <pid>
    <pid>.json     its registry entry (mode 0600): identity, start time, endpoints, the TCP key
    audit.jsonl    every action and eval, one JSON object a line
    hang-<pid>.txt stacks written by the hang watchdog (read back by offline_status)

With ``PROBE_REGISTRY`` set, entries are also written to that shared directory so
ranks on other nodes can be found. Who a process is (rank, job, argv) is ``_identity``'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import sys

from .config import setting
from ._errors import EndpointError
from .util.procfs import pid_alive


_private: dict = {}  # "path": the private directory a process fell back to when the usual one was unsafe


def default_runtime_dir() -> str:
    """PROBE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/probe, else /tmp/probe-<uid> (not created)."""
    path = setting("PROBE_RUNTIME_DIR")
    if not path:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        path = os.path.join(xdg, "probe") if xdg and os.path.isdir(xdg) else f"/tmp/probe-{os.getuid()}"
    return path


def check_private_dir(
    path: str, what: str = "the runtime directory", fix: str = "set PROBE_RUNTIME_DIR to a directory of your own"
) -> None:
    """Raise EndpointError unless ``path`` is a real directory (not a symlink) of this user, mode 0700 or stricter.

    Never follows a symlink and never changes what it finds: a directory someone else
    prepared (another user, a symlink to a directory of ours, a group-writable one) is
    refused, not repaired. ``what`` and ``fix`` name the directory and the way out in the sentence.
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise EndpointError(f"{what} {path} is a symbolic link; probe does not follow it (remove it, or {fix}).")
    if not stat.S_ISDIR(st.st_mode):
        raise EndpointError(f"{what} {path} is not a directory; remove it or {fix}.")
    if st.st_uid != os.getuid():
        raise EndpointError(f"{what} {path} belongs to another user (uid {st.st_uid}); {fix}.")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise EndpointError(
            f"{what} {path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"`chmod 700 {path}` it, or {fix}."
        )


def runtime_dir(create: bool = True) -> str:
    """The directory for sockets and registry entries of this user, created 0700 and checked (see check_private_dir)."""
    if _private.get("path"):
        return _private["path"]
    path = default_runtime_dir()
    if create:
        _make_private_dir(path)
        check_private_dir(path)
    return path


def _make_private_dir(path: str) -> None:
    """Create ``path`` (and missing parents) mode 0700 whatever the umask adds, never chmodded later; one that
    exists is left as it is, for ``check_private_dir`` to judge."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)


def use_private_dir(reason: str) -> str:
    """Fall back to a fresh private directory (mkdtemp: 0700, a name no one could prepare) and say so once."""
    import tempfile

    path = tempfile.mkdtemp(prefix=f"probe-{os.getuid()}-")
    _private["path"] = path
    print(
        f"[probe] {reason.rstrip('.')}; this process uses the private directory {path} instead "
        f"(run the CLI with PROBE_RUNTIME_DIR={path} to reach it).",
        file=sys.stderr,
        flush=True,
    )
    return path


def sweep_stale(path: str) -> int:
    """Remove temporary files (``*.<pid>.tmp``), sockets and injection files (``inject-<pid>-*``) left in ``path``
    for processes that died; how many."""
    removed = 0
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    for name in names:
        pid = None
        parts = name.split(".")
        if name.endswith(".tmp") and len(parts) >= 3 and parts[-2].isdigit():
            pid = int(parts[-2])
        elif name.endswith(".sock") and parts[0].isdigit():
            pid = int(parts[0])
        elif name.startswith("inject-") and name.split("-")[1].isdigit():  # an injection whose target died first
            pid = int(name.split("-")[1])
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        if name.endswith(".sock") and os.path.exists(os.path.join(path, f"{pid}.json")):
            continue  # read_entries(clean=True) removes the pair together
        removed += _unlink(os.path.join(path, name))
    return removed


_registry_refused: dict = {}  # path -> the sentence saying why this process does not use it (said once)
_registry_checked: set = set()  # paths found private and free of foreign files


def _refuse_registry(path: str, why: str) -> None:
    """Stop using the shared registry ``path`` in this process; say why once (stderr and probe.errors)."""
    if path in _registry_refused:
        return
    _registry_refused[path] = why
    text = f"{why.rstrip('.')}; this process goes on without the shared registry (PROBE_REGISTRY)"
    print(f"[probe] {text}.", file=sys.stderr, flush=True)
    try:
        from .util.errorlog import record_error

        record_error("shared registry", EndpointError(text + "."))
    except Exception:
        pass


def _foreign_file(path: str) -> str | None:
    """The first name in ``path`` (and its ``postmortem`` folder) that is a symlink or not this user's, or None."""
    me = os.getuid()
    for folder in (path, os.path.join(path, "postmortem")):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode) or st.st_uid != me or stat.S_IMODE(st.st_mode) & 0o022:
                return os.path.join(folder, name) + (
                    " (a symbolic link)"
                    if stat.S_ISLNK(st.st_mode)
                    else f" (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
                )
    return None


def shared_registry(create: bool = True) -> str | None:
    """The shared registry directory (PROBE_REGISTRY) when it may be trusted; None when unset, refused or missing.

    The runtime directory's rules apply: created 0700 when missing (``create``), else it must be
    a real directory of this user that no one else may enter, holding nothing that is a symlink
    or another user's. A directory that breaks a rule is refused, never repaired: the process
    says why once (stderr, ``probe.errors``) and goes on without it.
    """
    path = setting("PROBE_REGISTRY")
    if not path:
        return None
    path = os.path.abspath(path)
    if path in _registry_refused:
        return None
    if path in _registry_checked:
        return path
    fix = "point PROBE_REGISTRY at a directory of your own that only you can enter (mode 0700)"
    try:
        if not create and not os.path.exists(os.path.dirname(path)):
            return None
        _make_private_dir(path)
        check_private_dir(path, "the shared registry", fix)
    except EndpointError as exc:
        _refuse_registry(path, exc.message)
        return None
    except OSError as exc:
        _refuse_registry(path, f"the shared registry {path} cannot be used ({exc.strerror or exc})")
        return None
    foreign = _foreign_file(path)
    if foreign:
        _refuse_registry(
            path, f"the shared registry {path} holds a file probe did not write for you: {foreign}; remove it, or {fix}"
        )
        return None
    _registry_checked.add(path)
    return path


def read_private(path: str, limit: int = 1 << 20) -> bytes:
    """The bytes of ``path`` when it is a regular file of this user that no one else may write (never a symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o022:
            raise PermissionError(f"{path} is not a private file of this user")
        if st.st_size > limit:
            raise ValueError(f"{path} is larger than {limit} bytes")
        return os.read(fd, limit + 1)[:limit]
    finally:
        os.close(fd)


def _private_temp(path: str) -> tuple[int, str]:
    """A new 0600 file beside ``path`` under a name no one can predict (O_EXCL, O_NOFOLLOW); (fd, its path)."""
    import secrets

    tmp = f"{path}.{secrets.token_hex(8)}.{os.getpid()}.tmp"  # *.<pid>.tmp: sweep_stale removes a dead writer's
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), tmp


def job_token() -> str:
    """The token every rank of the job listens with: PROBE_TOKEN, else one shared through the registry.

    The first rank to get here creates ``<PROBE_REGISTRY>/token`` (mode 0600, written
    to a temporary file and linked into place, so no rank ever reads half a token);
    the others, on any node that mounts the directory, read the same one. A token file
    that is not a private file of this user is never adopted: the registry is refused.
    """
    import secrets

    token = setting("PROBE_TOKEN")
    if token:
        return token
    shared = shared_registry()
    if shared is None:
        return secrets.token_urlsafe(24)
    path = os.path.join(shared, "token")
    fd, tmp = _private_temp(path)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(24))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    try:
        token = read_private(path, 4096).decode().strip()
        if not token:
            raise ValueError("it is empty")
    except (OSError, ValueError) as exc:
        _refuse_registry(shared, f"the shared registry's token file {path} cannot be trusted ({exc})")
        return secrets.token_urlsafe(24)
    return token


def registry_listen(host: str | None, token: str | None) -> tuple[str, str, str]:
    """(port, bind address, token) for a rank that must be reachable through PROBE_REGISTRY.

    A free port on PROBE_HOST (loopback unless set: ranks on other nodes reach it only
    where the user opened it, e.g. PROBE_HOST=0.0.0.0), and the job's token.
    """
    bind = host or setting("PROBE_HOST")
    return "0", bind, token or job_token()


def _unlink(path: str | None) -> bool:
    """Remove ``path`` if there is one; whether it was removed (a file already gone is no error here)."""
    if not path:
        return False
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def _atomic_write(path: str, data: dict) -> None:
    fd, tmp = _private_temp(path)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


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
        _unlink(os.path.join(d, name))
        if i == 0:
            _unlink(os.path.join(d, f"{pid}.sock"))


def _valid_entry(entry) -> bool:
    """Whether a registry entry has the types readers rely on (a crafted one is skipped, not crashed on)."""
    if not isinstance(entry, dict) or type(entry.get("pid")) is not int or entry["pid"] <= 0:
        return False
    for key in ("rank", "local_rank", "world_size", "tcp_port"):
        if entry.get(key) is not None and type(entry[key]) is not int:
            return False
    for key in ("host", "socket", "tcp_host", "job", "key"):
        if entry.get(key) is not None and not isinstance(entry[key], str):
            return False
    if entry.get("proc_start") is not None and type(entry["proc_start"]) is not int:
        return False
    return entry.get("started_at") is None or isinstance(entry["started_at"], (int, float))


def process_is(pid: int, started: int | None) -> bool:
    """Whether ``pid`` runs here and is the process that started at ``started`` (``procfs.proc_start``; None when
    not known): a pid the kernel gave to a later process is not the one an entry or record was written for."""
    from .util.procfs import proc_start

    return pid_alive(pid) and (started is None or proc_start(pid) in (None, started))


def reused_pid(pid: int) -> str | None:
    """The sentence saying that this host's entry for ``pid`` names a process that is gone while another now has
    its pid, or None."""
    from .util.procfs import proc_start, start_time

    try:
        entry = json.loads(read_private(os.path.join(runtime_dir(create=False), f"{int(pid)}.json")))
    except (OSError, ValueError, UnicodeDecodeError, EndpointError):
        return None
    if not _valid_entry(entry) or entry["pid"] != pid or process_is(pid, entry.get("proc_start")):
        return None
    now = proc_start(pid)
    if now is None:
        return None
    import time

    when = start_time(now)
    since = f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))}" if when else "started later"
    return (
        f"pid {pid} is now another process ({since}); the job that had it is gone "
        "(`probe list --dead` shows what it left)."
    )


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
            try:  # a private file of this user only: a planted entry is never listed, and gets no token
                entry = json.loads(read_private(path))
            except (OSError, ValueError, UnicodeDecodeError):
                continue
            if not _valid_entry(entry):
                continue
            if entry.get("host", here) == here and not process_is(int(entry["pid"]), entry.get("proc_start")):
                if clean:
                    _unlink(path)
                    _unlink(entry.get("socket"))
                continue
            key = (entry.get("host"), entry["pid"])
            if key not in entries or not entry.get("shared"):
                entries[key] = entry
    return sorted(entries.values(), key=lambda e: (e.get("rank") is None, e.get("rank") or 0, e["pid"]))


def offline_status(entry: dict) -> dict:
    """What the dump file says about a process whose server does not answer (the GIL held in C).

    Read by the CLI from the runtime directory: a dump written after the process
    started means the watchdog fired; ``hung_since`` is the firing time minus the
    timeout from faulthandler's ``Timeout (H:MM:SS.ffffff)!`` header, i.e. its last re-arm (at most
    about a second before the last step).
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
    stamps = re.findall(r"Timeout \((\d+):(\d\d):(\d\d(?:\.\d+)?)\)!", tail)
    timeout = 0.0
    if stamps:
        h, m, s = stamps[-1]
        timeout = int(h) * 3600 + int(m) * 60 + float(s)
    return {"state": "hung", "hung_since": st.st_mtime - timeout, "hang_dump": path}
