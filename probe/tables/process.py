"""process.info and process.env: who this process is."""

from __future__ import annotations

import os
import sys
import threading

from .._core import state
from .._identity import process_argv, rank_identity
from ..util.procfs import rss_bytes
from ..util.printable import redact
from .python import thread_state
from .registry import Column, table


def _info_row(ctx) -> dict:
    entry = state.info()
    started = entry.get("started_at")
    row = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "argv": " ".join(process_argv()),
        "cwd": os.getcwd(),
        "python": sys.version.split()[0],
        "torch": getattr(sys.modules.get("torch"), "__version__", None),
        **rank_identity(),  # host, rank, local_rank, world_size, node_rank
        "job": entry.get("job"),
        "rss_bytes": rss_bytes(),
        "threads": len(sys._current_frames()),
        "probe_started_at": started,
        "uptime_s": (ctx.time - started) if started else None,
        "socket": entry.get("socket"),
        "tcp_port": entry.get("tcp_port"),
    }
    # the main thread's scheduler state: a stall is judged only while it does not run (sql.ranks: ranks.status)
    row["main_state"] = thread_state(threading.main_thread())
    status = state.status()  # status providers: step counter (torch), hang watchdog
    for key in ("step", "last_step_at", "state", "hung_since"):
        row[key] = status.get(key)
    row.update(source="live", exit_cause=None, exited_at=None, exit_reason=None)  # a post-mortem reader fills these
    return row


@table(
    "process.info",
    "One row describing this process: identity, rank, resources and probe endpoints.",
    columns=[
        Column("pid", "BIGINT", "Process id."),
        Column("ppid", "BIGINT", "Parent process id (torchrun's agent under torchrun)."),
        Column("argv", "VARCHAR", "Command line, space separated."),
        Column("cwd", "VARCHAR", "Working directory."),
        Column("python", "VARCHAR", "Python version."),
        Column("torch", "VARCHAR", "torch version if torch is imported, else NULL."),
        Column("host", "VARCHAR", "Host name."),
        Column("rank", "INTEGER", "Global rank from RANK (or SLURM_PROCID), NULL outside a distributed job."),
        Column("local_rank", "INTEGER", "Rank on this node from LOCAL_RANK (or SLURM_LOCALID)."),
        Column("world_size", "INTEGER", "Number of ranks from WORLD_SIZE (or SLURM_NTASKS)."),
        Column("node_rank", "INTEGER", "Node index from GROUP_RANK/NODE_RANK (or SLURM_NODEID)."),
        Column(
            "job",
            "VARCHAR",
            "Job identity: Slurm job id, torchrun's run id, the rendezvous endpoint MASTER_ADDR:MASTER_PORT, or the "
            "launcher's pid; NULL outside a distributed job.",
        ),
        Column("rss_bytes", "BIGINT", "Resident memory of the process in bytes."),
        Column("threads", "INTEGER", "Number of Python threads."),
        Column("probe_started_at", "TIMESTAMP", "When the probe server started in this process."),
        Column("uptime_s", "DOUBLE", "Seconds since the probe started."),
        Column("socket", "VARCHAR", "Path of the probe's unix socket."),
        Column("tcp_port", "INTEGER", "TCP port of the probe, NULL when it listens on the unix socket only."),
        Column(
            "main_state",
            "VARCHAR",
            "OS scheduler state of the main thread from /proc (running, sleeping, disk-wait, ...), as "
            "python.threads.state.",
        ),
        Column("step", "BIGINT", "Last completed training step, NULL before the first one."),
        Column("last_step_at", "TIMESTAMP", "When the last step completed."),
        Column(
            "state",
            "VARCHAR",
            "training, idle (no step seen yet), hung (the hang watchdog fired), or dead (read from the post-mortem "
            "record of a process that is gone).",
        ),
        Column(
            "hung_since",
            "TIMESTAMP",
            "When the hang watchdog last heard a step (within a second of the last one), if it fired; else NULL.",
        ),
        Column(
            "source",
            "VARCHAR",
            "live (answered by the running process) or postmortem (read from the record a dead process left, see "
            "docs/postmortem.md).",
        ),
        Column(
            "exit_cause",
            "VARCHAR",
            "How a dead process ended: exception, thread_exception, interrupted, terminated (SIGTERM), exit, "
            "fatal_signal or killed; NULL while it runs.",
        ),
        Column(
            "exited_at",
            "TIMESTAMP",
            "When a dead process's record was written (its death, or its last periodic snapshot when killed); NULL "
            "while it runs.",
        ),
        Column(
            "exit_reason",
            "VARCHAR",
            "How a dead process ended, in words: the exception and where it was raised, the fatal signal, a SIGTERM, "
            "the code of sys.exit(N), or a kill without warning; NULL while it runs.",
        ),
    ],
    examples=[
        "SELECT pid, rank, world_size, rss_bytes / 1e6 AS rss_mb FROM process.info",
        "SELECT pid, source, state, exit_cause, exit_reason FROM process.info",
    ],
)
def info(ctx):
    return [_info_row(ctx)]


@table(
    "process.env",
    "Environment variables of this process; values of names that look secret are redacted.",
    columns=[
        Column("name", "VARCHAR", "Variable name."),
        Column(
            "value",
            "VARCHAR",
            "Its value, or '<redacted>' when the name looks like a token, key, password or credential.",
        ),
    ],
    examples=["SELECT name, value FROM process.env WHERE name LIKE 'PROBE%' OR name LIKE 'NCCL%' ORDER BY name"],
)
def env(ctx):
    return sorted((k, redact(k, v)) for k, v in os.environ.items())
