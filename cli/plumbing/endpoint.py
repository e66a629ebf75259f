"""Resolve what the user typed (a pid, host:port, a socket path, --rank N) to a Target."""

from __future__ import annotations

import os
import re

from probe._errors import EndpointError
from probe._runtime import read_entries, reused_pid
from probe.util.procfs import pid_alive


class Target:
    """One probed process to talk to (a plain class: dataclasses cost start-up time)."""

    def __init__(
        self,
        label: str,
        socket: str | None = None,
        host: str | None = None,
        port: int | None = None,
        token: str | None = None,
        pid: int | None = None,
        rank: int | None = None,
        entry: dict | None = None,
        key: str | None = None,
    ):
        self.label, self.socket, self.host, self.port = label, socket, host, port
        self.token, self.pid, self.rank = token, pid, rank
        self.key = key  # the rank's key from its registry entry (``token``: one the person typed)
        self.entry = entry if entry is not None else {}

    def __repr__(self) -> str:
        return f"Target({self.label!r}, socket={self.socket!r}, host={self.host!r}, port={self.port!r})"

    @property
    def local_pid(self) -> int | None:
        """The pid when the process runs on this host (py-spy can read it), else None."""
        if self.pid is None:
            return None
        import socket as _s

        host = self.entry.get("host")
        return self.pid if host in (None, _s.gethostname()) else None


def _python_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _from_record(rec) -> Target:
    """A Target answered from a dead process's post-mortem record (see cli.plumbing.postmortem)."""
    label = f"rank {rec.rank}" if rec.rank is not None else f"pid {rec.pid}"
    target = Target(label, pid=rec.pid, rank=rec.rank, entry=rec.entry)
    target.record = rec
    return target


def _record_entries(job: str | None, live: list[dict]) -> list[dict]:
    """Entries for the dead ranks of ``job`` (post-mortem records, here and in PROBE_REGISTRY) no live process holds.

    A record joins only when its process started no earlier than 10 minutes before the
    job's oldest live rank: a job id such as MASTER_ADDR:MASTER_PORT can come back in a
    later run, whose ranks an old run's records must not pass for.
    """
    if not job:
        return []
    from .postmortem import job_records

    held = {int(e["rank"]) for e in live if e.get("rank") is not None}
    started = [float(e["started_at"]) for e in live if e.get("started_at")]
    out = []
    for rec in job_records(job):
        began = rec.meta.get("started_at")
        if int(rec.rank) in held or (started and began is not None and float(began) < min(started) - 600):
            continue
        out.append(dict(rec.entry, record=rec))
    return out


def from_entry(entry: dict, token: str | None) -> Target:
    if entry.get("record") is not None:
        return _from_record(entry["record"])
    label = f"rank {entry['rank']}" if entry.get("rank") is not None else f"pid {entry['pid']}"
    import socket as _s

    if entry.get("host") in (None, _s.gethostname()) and entry.get("socket") and os.path.exists(entry["socket"]):
        return Target(label, socket=entry["socket"], pid=entry["pid"], rank=entry.get("rank"), entry=entry)
    if entry.get("tcp_port"):
        host = entry.get("tcp_host") or entry.get("host")
        if host in ("0.0.0.0", "::"):
            host = entry.get("host")
        elif host in _LOOPBACK and entry.get("host") not in (None, _s.gethostname()):
            raise EndpointError(
                f"{label} on {entry['host']} listens on its loopback only; start the job with PROBE_HOST set to that "
                "node's address (or 0.0.0.0) so other hosts can reach it."
            )
        return Target(
            label,
            host=host,
            port=int(entry["tcp_port"]),
            token=token,
            pid=entry["pid"],
            rank=entry.get("rank"),
            entry=entry,
            key=None if token else entry.get("key"),  # a token the person typed is the one they mean
        )
    raise EndpointError(
        f"{label} on {entry.get('host')} has no reachable endpoint; start it with PROBE_PORT set so other hosts can "
        "reach it."
    )


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _addresses_of(entry: dict) -> set:
    """Names under which a registry entry's TCP listener is reached: its key is used only for these (host AND port).

    >>> sorted(_addresses_of({"tcp_host": "127.0.0.1", "host": "node1"}))
    ['127.0.0.1', 'localhost']
    >>> "10.0.0.5" in _addresses_of({"tcp_host": "127.0.0.1", "host": "node1"})
    False
    """
    bound = entry.get("tcp_host") or ""
    names = {bound}
    if bound in ("127.0.0.1", "::1"):
        names.add("localhost")
    if bound in ("0.0.0.0", "::"):
        names.update(_LOOPBACK)
        names.add(entry.get("host") or "")
    names.discard("")
    return names


def _typed(token: str | None, agent: str | None) -> str | None:
    """The token a request may prove itself with besides the registry's key: the one the person typed
    (``--token``, ``PROBE_TOKEN``) is used where that person pointed the command (the CLI, the REPL, ``probe
    ui``'s command line); a program choosing endpoints for someone (``agent``: MCP) gets none, only the
    registry's key for the host and port it was issued for. Neither is ever sent (``probe.util.handshake``)."""
    return None if agent else token


def _unregistered(endpoint: str) -> str:
    return (
        f"{endpoint} is not the endpoint of a probed process in the registry; an agent may use only a pid or the "
        "socket or address that `list` shows for it."
    )


def resolve(endpoint: str, token: str | None = None, *, agent: str | None = None) -> Target:
    """A pid, ``host:port``, ``[v6]:port`` or a unix-socket path; ``agent``: see ``_typed``.

    For an ``agent`` (a program choosing endpoints for someone), a socket path or address must be one that a
    registry entry names: a tool is never pointed at any other listener on the host."""
    token = _typed(token, agent)
    endpoint = endpoint.strip()
    if endpoint.isdigit():
        pid = int(endpoint)
        entries = {e["pid"]: e for e in read_entries() if not e.get("shared")}
        if pid in entries:
            return from_entry(entries[pid], token)
        reused = reused_pid(pid)
        if reused:  # never read another process (py-spy, the injector) as the job's
            raise EndpointError(reused)
        if not pid_alive(pid):
            from .postmortem import find

            rec = find(pid)
            if rec is not None:
                return _from_record(rec)
            raise EndpointError(f"no process with pid {pid} is running; `probe list` shows the probed processes.")
        hint = "run `probe inject %d` to start one, or start the job with `import probe.auto` or PROBE=1" % pid
        if not _python_cmdline(pid):
            hint = "its command line cannot be read; " + hint
        target = Target(f"pid {pid}", pid=pid)
        target.entry = {"pid": pid, "missing": True, "hint": f"process {pid} has no probe server; {hint}."}
        return target
    m = re.match(r"^\[?([A-Za-z0-9_.:\-]+?)\]?:(\d+)$", endpoint)
    if m and "/" not in endpoint:
        host, port = m.group(1), int(m.group(2))
        entry: dict = {}
        if token is None:  # a token the person typed is the one they mean; else the registry's key for this address
            for e in read_entries():
                if e.get("tcp_port") == port and e.get("key") and host in _addresses_of(e):
                    entry = e
                    break
        if agent and not entry:
            for e in read_entries():
                if e.get("tcp_port") == port and host in _addresses_of(e):
                    entry = e
                    break
            else:
                raise EndpointError(_unregistered(endpoint))
        return Target(
            endpoint,
            host=host,
            port=port,
            token=token,
            pid=entry.get("pid"),
            rank=entry.get("rank"),
            entry=entry or None,
            key=entry.get("key"),
        )
    if "/" in endpoint or endpoint.endswith(".sock"):
        if not os.path.exists(endpoint):
            raise EndpointError(f"no socket at {endpoint}; `probe list` shows the probed processes and their sockets.")
        if agent:
            real = os.path.realpath(endpoint)
            for e in read_entries():
                if e.get("socket") and os.path.realpath(e["socket"]) == real:
                    return from_entry(e, token)
            raise EndpointError(_unregistered(endpoint))
        return Target(endpoint, socket=endpoint)
    raise EndpointError(f"'{endpoint}' is not an endpoint; give a pid, host:port, or a socket path (see `probe list`).")


def parse_rank_spec(spec: str) -> list[int] | None:
    """``all`` -> None (every rank); ``0-3,7`` -> [0, 1, 2, 3, 7]."""
    spec = spec.strip().lower()
    if spec == "all":
        return None
    ranks: list[int] = []
    try:
        for part in spec.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                if int(hi) < int(lo):
                    raise ValueError
                ranks.extend(range(int(lo), int(hi) + 1))
            elif part:
                ranks.append(int(part))
    except ValueError:
        raise EndpointError(
            f"'{spec}' is not a rank list; use all, a rank (3), a range (0-3) or a list (0-3,7)."
        ) from None
    if not ranks:
        raise EndpointError("the rank list is empty; use all, a rank (3), a range (0-3) or a list (0-3,7).")
    return sorted(set(ranks))


def pick_job(entries: list[dict], job: str | None) -> list[dict]:
    """The entries of one job: ``job`` (a job id or its unique prefix), or the only job there is.

    Several jobs and no ``job``: an error naming them, never a silent mix of their ranks.
    """
    jobs = sorted({str(e.get("job")) for e in entries if e.get("job")})
    if job is not None:
        chosen = [j for j in jobs if j == job] or [j for j in jobs if j.startswith(job)]
        if len(chosen) != 1:
            what = "matches several jobs" if chosen else "is not a job in the registry"
            raise EndpointError(f"--job {job} {what}; the jobs are: {', '.join(jobs) or 'none'} (see `probe list`).")
        return [e for e in entries if str(e.get("job")) == chosen[0]]
    if len(jobs) > 1:
        raise EndpointError(
            f"ranks of {len(jobs)} jobs are probed here ({', '.join(jobs)}); pick one with --job ID "
            "(`probe list` shows each process's job)."
        )
    return entries


def targets_for_ranks(
    ranks: list[int] | None, token: str | None = None, job: str | None = None, *, agent: str | None = None
) -> list[Target]:
    """Targets of the given ranks (None: every rank) of one job from the local and shared registries; ``agent``:
    see ``_typed``."""
    token = _typed(token, agent)
    entries = [e for e in read_entries(clean=True) if e.get("rank") is not None]
    if entries:
        entries = pick_job(entries, job)
        entries += _record_entries(next((e.get("job") for e in entries if e.get("job")), None), entries)
    else:  # every rank is gone: the job's post-mortem records answer for it
        from .postmortem import list_records

        dead = [m for m in list_records() if m.get("rank") is not None and m.get("job")]
        jobs = sorted({str(m["job"]) for m in dead})
        if job is None and len(jobs) > 1:  # not a choice between running jobs: none runs
            raise EndpointError(
                f"no job is running here: every probed rank has exited; {len(jobs)} ended jobs left "
                f"post-mortem records ({', '.join(jobs)}): `probe list --dead` shows them, and "
                "--job ID reads one's records."
            )
        chosen = pick_job(dead, job)
        entries = _record_entries(chosen[0]["job"], []) if chosen else []
    if not entries:
        raise EndpointError(
            "no probed ranks were found in the registry; start the job with PROBE=1 (set PROBE_REGISTRY for several "
            "nodes) or check `probe list`."
        )
    by_rank: dict[int, dict] = {}
    for e in entries:
        by_rank.setdefault(int(e["rank"]), e)
    # "all" means every rank of the job: a rank whose process exited still gets a row saying so
    world = max((int(e["world_size"]) for e in entries if e.get("world_size")), default=0)
    wanted = sorted(set(by_rank) | set(range(world))) if ranks is None else ranks
    missing = [r for r in wanted if r not in by_rank]
    if missing and ranks is not None and len(missing) == len(wanted):
        known = ", ".join(str(r) for r in sorted(by_rank))
        raise EndpointError(f"no probed process has rank {', '.join(map(str, missing))}; known ranks: {known}.")
    out = []
    for r in wanted:
        if r in by_rank:
            out.append(from_entry(by_rank[r], token))
        else:
            out.append(
                Target(
                    f"rank {r}",
                    rank=r,
                    entry={
                        "missing": True,
                        "hint": f"rank {r} is not in the registry: its process exited or never started a probe",
                    },
                )
            )
    return out
