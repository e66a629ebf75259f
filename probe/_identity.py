"""Who this process is: its rank in a distributed job, the job it belongs to, and its command line.

The rank comes from the launcher's environment (torchrun's variables, else Slurm's, else
Open MPI's), so it is known before any process group exists; the job identity tells several
jobs on one host apart (registry entries carry it).
"""

from __future__ import annotations

import os
import socket
import sys


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


def job_identity(environ: dict | None = None) -> str | None:
    """Which job this process belongs to, so that several jobs on one host are told apart.

    Slurm's job (and step) id; else torchrun's run id (TORCHELASTIC_RUN_ID, unless it is
    the default ``none``); else the rendezvous endpoint MASTER_ADDR:MASTER_PORT (unique
    while the job runs: its port is bound); else, for a process with a rank but none of
    these, its launcher (parent pid and host). None outside a distributed job.

    >>> job_identity({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"})
    'node1:29500'
    >>> job_identity({"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "0", "TORCHELASTIC_RUN_ID": "x"})
    'slurm-812.0'
    """
    env = os.environ if environ is None else environ
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID")
        return f"slurm-{env['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id.lower() != "none":
        return run_id
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    for name in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"):
        if env.get(name):
            return f"mpi-{env[name]}"
    if any(env.get(n) not in (None, "") for n in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")):
        return f"ppid-{os.getppid()}@{socket.gethostname()}"
    return None


def process_argv() -> list[str]:
    """This process's argv from /proc (usable before ``sys.argv`` is set), else sys.argv."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            parts = f.read().split(b"\0")
        return [p.decode(errors="replace") for p in parts if p]
    except OSError:
        return list(getattr(sys, "argv", []) or [])
